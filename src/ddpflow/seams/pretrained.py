"""Where `model.weights` points: a file, or a torchvision weights name in the local torch hub
cache (never downloaded). Torch-free at import: provenance and collect ask it too, and they only
read files."""

from __future__ import annotations

from pathlib import Path

from ddpflow.core.errors import UserError, short


def hub_file(model_name: str, spec: str) -> Path:
    """The torch hub cache file of a torchvision weights enum (DEFAULT, IMAGENET1K_V1 ...)."""
    import torch
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model_name)
        w = enum[spec.split(".")[-1]]
    except (KeyError, ValueError):
        names = ", ".join(["DEFAULT"] + [w.name for w in
                                          torchvision.models.get_model_weights(model_name)])
        raise UserError(f"model.weights {short(spec)} is not a file nor a weights name of "
                        f"{model_name} ({names})") from None
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    path = cache / Path(w.url).name
    if not path.is_file():
        raise UserError(f"model.weights {spec}: {path.name} is not in the local torch hub cache "
                        f"{cache}; compute nodes often have no internet, so ddpflow never "
                        f"downloads: fetch {w.url} elsewhere and copy it there (TORCH_HOME moves "
                        f"the cache)")
    return path


def pretrained_file(cfg) -> Path | None:
    """model.weights as a file path (a torchvision weights name resolved in the hub cache)."""
    spec = cfg.model.weights
    if not spec:
        return None
    from ddpflow.seams.models import kind

    path = Path(spec)
    if path.suffix or "/" in spec or kind(cfg.model.name) != "torchvision":
        return path
    return hub_file(cfg.model.name, spec)
