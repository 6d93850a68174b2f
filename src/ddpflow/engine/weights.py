"""A stage's starting weights and frozen parameters.

Two ways in, with two rules:
  stages[i].init_from   the previous stage or a file of this very model: every tensor must
                        fit (a mismatch is an error naming the first tensor)
  model.weights         pretrained weights (stages without init_from): a .pt/.pth state dict
                        (always weights_only), a .safetensors file, a ddpflow final.pt/best.pt,
                        or for torchvision models DEFAULT / a weights enum name, read from the
                        local torch hub cache only. Tensors whose shape differs (the head of a
                        model with another class count) stay freshly initialised; a tensor
                        missing on either side is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddpflow.core.errors import UserError, short
from ddpflow.seams.pretrained import hub_file, pretrained_file  # noqa: F401

if TYPE_CHECKING:
    import torch
    from torch import nn
# torch and checkpoint are imported where they are used


def read_state_dict(path: Path, setting: str) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch file (weights_only), 'module.' prefixes
    (a DDP-wrapped save) removed."""
    if not path.is_file():
        raise UserError(f"{setting}: {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:  # a slim image or environment without it
            raise UserError(f"{setting}: {path} is a .safetensors file and the safetensors "
                            f"package is not installed here: pip install safetensors") from None

        try:
            sd = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
            raise UserError(f"{setting}: {path} cannot be read as safetensors "
                            f"({type(e).__name__}: {str(e)[:160]})") from None
    else:
        from ddpflow.engine import checkpoint

        sd = checkpoint.load_weights(path, setting)
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def load_pretrained(model: nn.Module, sd: dict, setting: str) -> dict:
    """Load what fits; tensors of another shape stay initialised. Returns the counts."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        first = (f"the model's '{missing[0]}' is not in the file" if missing
                 else f"the file's '{unexpected[0]}' is not in the model")
        raise UserError(f"{setting} does not fit model.name: {first} ({len(missing)} missing, "
                        f"{len(unexpected)} unexpected tensors); is it another architecture?")
    reinit = [k for k in own if tuple(sd[k].shape) != tuple(own[k].shape)]
    fit = {k: sd[k] for k in own if k not in reinit}
    if not fit:
        raise UserError(f"{setting}: no tensor of the file has the model's shape")
    model.load_state_dict(fit, strict=False)
    return {"loaded": len(fit), "skipped": len(reinit), "reinitialised": reinit}


def freeze(model: nn.Module, prefixes, setting: str) -> int:
    """requires_grad=False for parameters whose name starts with a prefix; returns how many
    parameters were frozen. A prefix that matches nothing is an error (a typo)."""
    if not prefixes:
        return 0
    names = [n for n, _ in model.named_parameters()]
    for pre in prefixes:
        if not any(n.startswith(pre) for n in names):
            raise UserError(f"{setting}: no parameter name starts with {short(pre)}; names "
                            f"look like {', '.join(names[:4])}")
    frozen = 0
    for name, p in model.named_parameters():
        if any(name.startswith(pre) for pre in prefixes):
            p.requires_grad_(False)
            frozen += 1
    if frozen == len(names):
        raise UserError(f"{setting} freezes every parameter: nothing would train")
    return frozen


def start_weights(cfg, st, model: nn.Module, src: Path | None, say) -> dict | None:
    """Load the stage's starting weights into `model` and freeze what the stage freezes.
    Returns what happened, for the log and summary.json."""
    i = cfg.stage_index(st.name)
    report = None
    if src is not None and st.init_from:
        setting = f"stages.{i}.init_from {src}"
        if not src.is_file():
            raise UserError(f"{setting} does not exist; run the earlier stage first or fix "
                            f"the path")
        from ddpflow.engine import checkpoint

        weights = checkpoint.load_weights(src, setting)
        checkpoint.check_fits(model, weights, setting)
        model.load_state_dict(weights)
        report = {"from": str(src), "loaded": len(weights), "skipped": 0, "reinitialised": []}
        say(f"initialised from {src}")
    elif src is not None:
        report = load_pretrained(model, read_state_dict(src, "model.weights"),
                                 f"model.weights {src}")
        report = {"from": str(src), **report}
        shown = ", ".join(report["reinitialised"][:4])
        say(f"model.weights {src}: {report['loaded']} tensors loaded, {report['skipped']} "
            f"skipped (shape differs), {len(report['reinitialised'])} re-initialised"
            + (f" ({shown})" if shown else ""))
    prefixes = st.freeze if st.freeze is not None else cfg.model.freeze
    setting = f"stages.{i}.freeze" if st.freeze is not None else "model.freeze"
    frozen = freeze(model, prefixes, setting)
    if frozen:
        say(f"{frozen} parameter tensors frozen ({', '.join(prefixes)})")
    if report is not None or frozen:
        report = {**(report or {}), "frozen": frozen}
    return report
