"""A user's own model: a plain nn.Module, nothing from ddpflow, torchvision or timm.

ddpflow calls `build(num_classes=..., in_channels=..., **model.kwargs)`; the parameter
names `backbone.*` and `head.*` are what `freeze: [backbone]` refers to.
"""

from torch import nn


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.backbone = nn.Sequential(block(in_channels, width), block(width, 2 * width),
                                      block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def build(num_classes: int, in_channels: int = 3, width: int = 16) -> nn.Module:
    return TinyNet(num_classes, in_channels, width)
