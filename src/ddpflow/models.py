"""Models by name: `smallcnn` and `mlp` (small built-ins), or any torchvision classifier."""

from __future__ import annotations

from torch import nn

from .errors import UserError


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; learns the synthetic set in a few CPU epochs."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.features = nn.Sequential(
            block(in_channels, width), nn.MaxPool2d(2),
            block(width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


class MLP(nn.Module):
    """Two linear layers on the image pooled to 8 x 8, no BatchNorm: a baseline, and the
    model for tests that need a loss that is exactly a mean over samples (no batch
    statistics)."""

    def __init__(self, num_classes: int, in_channels: int = 3, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(),
                                 nn.Linear(in_channels * 64, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


BUILTIN = {"smallcnn": SmallCNN, "mlp": MLP}


def input_channels(name: str, data_channels: int) -> int:
    """Channels the model takes: the built-ins adapt to the data, torchvision models want 3."""
    return data_channels if name in BUILTIN else 3


def build_model(name: str, num_classes: int, data_channels: int) -> nn.Module:
    if name in BUILTIN:
        return BUILTIN[name](num_classes, in_channels=data_channels)
    import torchvision  # imported only here: a CPU-only image may lack a matching torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        close = [m for m in available if m.startswith(name[:4])][:8]
        raise UserError(f"model.name '{name}' is not one of {sorted(BUILTIN)} nor a torchvision "
                        f"classification model" + (f"; close: {', '.join(close)}" if close else ""))
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


