"""Make this example's inputs: a small image folder (3 classes of coloured shapes) and
`pretrained.pt`, TinyNet weights "pretrained" for a few seconds on 10 other classes.

    python examples/own_model/make_assets.py

Your own project has real images and a real checkpoint instead; nothing here is needed
by ddpflow itself.
"""

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SHAPES = {"discs": "ellipse", "squares": "rectangle", "triangles": "polygon"}


def draw(kind: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    bg = tuple(int(c) for c in rng.integers(0, 90, 3))
    fg = tuple(int(c) for c in rng.integers(150, 256, 3))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    r = int(rng.integers(7, 12))
    cx, cy = (int(v) for v in rng.integers(r + 1, size - r - 1, 2))
    box = [cx - r, cy - r, cx + r, cy + r]
    if kind == "polygon":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        getattr(d, kind)(box, fill=fg)
    return img


def image_folder(root: Path, per_class: int = 80, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for name, kind in SHAPES.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw(kind, rng).save(root / name / f"{i:03d}.png")


def pretrain(path: Path, steps: int = 60) -> None:
    """TinyNet with a 10-class head, trained briefly on random 10-class colour patterns."""
    import sys

    sys.path.insert(0, str(HERE))
    from tinynet import build

    torch.manual_seed(0)
    model = build(num_classes=10)
    templates = torch.rand(10, 3, 1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        y = torch.randint(0, 10, (32,))
        x = templates[y] + 0.1 * torch.randn(32, 3, 32, 32)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), path)


if __name__ == "__main__":
    image_folder(HERE / "data")
    pretrain(HERE / "pretrained.pt")
    print(f"wrote {HERE / 'data'} and {HERE / 'pretrained.pt'}")
