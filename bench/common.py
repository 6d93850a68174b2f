"""Shared by the benchmark scripts: one stage through the real `ddpflow launch`, and the
DataLoader over decoded PIL images with per-sample transforms that users write by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml


def launch_stage(tmp: Path, name: str, cfg: dict, prepare: bool = True) -> dict:
    """Write cfg, prepare its data, run stage `name` with ddpflow launch; its summary."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if prepare:
        subprocess.run([sys.executable, "-m", "ddpflow", "prepare", "-c", str(path)],
                       check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "ddpflow", "launch", "-c", str(path), "--stage", name],
                   check=True, capture_output=True)
    run_dir = Path(cfg["results_dir"]) / cfg["run"]
    summary = json.loads((run_dir / "stages" / name / "summary.json").read_text())
    if summary["mean_samples_per_s"] is None:
        sys.exit(f"stage {name}: too few steps to measure (the first log interval is warm-up)")
    return summary


def pil_loader(images, labels, batch, mean, std, workers, sampler=None, crop=None,
               collate=None):
    """A DataLoader over PIL images: `crop` (default RandomCrop(pad 4)), flip, ToTensor,
    Normalize, per sample in the workers; `collate` (e.g. with torchvision's MixUp)."""
    import torchvision.transforms as T
    from PIL import Image

    class PILSet(torch.utils.data.Dataset):
        def __init__(self):
            self.pil = [Image.fromarray(x) for x in images]  # decoded, as in CIFAR10()
            first = crop or T.RandomCrop(images.shape[1], padding=4)
            self.tf = T.Compose([first, T.RandomHorizontalFlip(), T.ToTensor(),
                                 T.Normalize(mean, std)])

        def __len__(self):
            return len(self.pil)

        def __getitem__(self, i):
            return self.tf(self.pil[i]), int(labels[i])

    ds = PILSet()
    sampler = sampler(ds) if sampler else None
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=sampler is None,
                                       sampler=sampler, num_workers=workers, drop_last=True,
                                       persistent_workers=workers > 0, collate_fn=collate)
