"""A stage's starting weights and frozen parameters.

Two ways in, with two rules:
  stages[i].init_from   the previous stage or a file of this very model: every tensor must
                        fit (a mismatch is an error naming the first tensor)
  model.weights         pretrained weights (stages without init_from): a .pt/.pth state dict
                        (always weights_only), a .safetensors file, a ddpflow final.pt/best.pt,
                        or for torchvision models DEFAULT / a weights enum name, read from the
                        local torch hub cache only. Only the model's final layer (the
                        classifier head of another class count) may differ or be missing: it
                        stays freshly initialised. Anything more is one error listing what
                        does not fit, unless model.weights_partial: true (then what fits is
                        loaded, the rest starts fresh, and summary.json's `init` says which).
A file's NaN/inf tensors are an error naming the file and the tensor (not a diverging run).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddpflow.core.errors import UserError, short
from ddpflow.core.reading import existing
from ddpflow.seams.pretrained import hub_file, pretrained_file  # noqa: F401

if TYPE_CHECKING:
    import torch
    from torch import nn
# torch and checkpoint are imported where they are used


def read_state_dict(path: Path, setting: str) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch file (weights_only), 'module.' prefixes
    (a DDP-wrapped save) removed."""
    existing(path, setting, "give the weights file (.pt, .pth, .safetensors or a ddpflow "
             "final.pt/best.pt)")
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
    check_finite(sd, f"{setting}: {path}")
    return sd


def check_finite(sd: dict, where: str) -> None:
    """Starting weights with NaN/inf would make the first loss NaN: named here instead of
    as a diverging run (which would blame the learning rate)."""
    import torch

    for name, t in sd.items():
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise UserError(f"{where}: tensor '{name}' holds {bad} NaN/inf of its {t.numel()} "
                            f"values; the starting weights are broken (not a learning-rate "
                            f"problem): save them again from a healthy model")


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def final_layer(names) -> set[str]:
    """The tensors of the last layer with a weight or bias (the classifier head)."""
    names = list(names)
    last = next((k for k in reversed(names) if k.rsplit(".", 1)[-1] in ("weight", "bias")),
                None)
    return set() if last is None else {k for k in names if _layer(k) == _layer(last)}


def _shape(t) -> str:
    return str(tuple(t.shape)).replace(",)", ")")


def _misfits(own: dict, sd: dict) -> tuple[list, list, list, list[str]]:
    """(missing, unexpected, reshaped, beyond the head: 'name: what' lines)."""
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    reshaped = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    head, file_head = final_layer(own), final_layer(sd)
    classes = {own[k].shape[0] for k in head if own[k].ndim}
    beyond = []
    for k in reshaped:  # a head of another class count: only dim 0 differs (aux heads too)
        a, b = tuple(own[k].shape), tuple(sd[k].shape)
        if not (k in head or (len(a) == len(b) and a[1:] == b[1:] and a[:1] and
                              a[0] in classes)):
            beyond.append(f"'{k}' {_shape(sd[k])} in the file, {_shape(own[k])} in the model")
    beyond += [f"'{k}' {_shape(own[k])} is not in the file" for k in missing if k not in head]
    beyond += [f"'{k}' {_shape(sd[k])} is not in the model" for k in unexpected
               if k not in file_head]
    return missing, unexpected, reshaped, beyond


def load_pretrained(model: nn.Module, sd: dict, setting: str, partial: bool = False) -> dict:
    """Load what fits. Only the final layer may differ or be missing (it stays initialised);
    more is one UserError listing what does not fit, unless `partial` (model.weights_partial).
    Returns what was loaded and re-initialised."""
    own = model.state_dict()
    missing, unexpected, reshaped, beyond = _misfits(own, sd)
    fit = {k: sd[k] for k in own if k in sd and k not in reshaped}
    if beyond and not partial:
        more = f"; and {len(beyond) - 8} more" if len(beyond) > 8 else ""
        allow = (f"or set model.weights_partial: true to load the {len(fit)} tensors that fit "
                 f"and start the rest fresh" if fit else "no tensor fits at all")
        raise UserError(
            f"{setting} does not fit model.name beyond its final layer ({len(beyond)} "
            f"tensors; the model has {len(own)}, the file {len(sd)}): {'; '.join(beyond[:8])}"
            f"{more}; is it another architecture or size? Fix model.name/model.kwargs or the "
            f"file, {allow}")
    if not fit:
        raise UserError(f"{setting}: no tensor of the file has the model's name and shape; "
                        f"is it another architecture?")
    model.load_state_dict(fit, strict=False)
    report = {"loaded": len(fit), "skipped": len(reshaped) + len(unexpected),
              "reinitialised": reshaped + missing}
    if unexpected:
        report["unused"] = unexpected
    if partial:
        report["partial"] = True
    return report


def freeze(model: nn.Module, prefixes, setting: str) -> int:
    """requires_grad=False for parameters whose name starts with a prefix; returns how many
    parameters were frozen. Prefixes that match nothing (typos), or freezing every
    parameter, are one error."""
    if not prefixes:
        return 0
    names = [n for n, _ in model.named_parameters()]
    unmatched = [pre for pre in prefixes if not any(n.startswith(pre) for n in names)]
    if unmatched:
        tops = sorted({n.split(".")[0] for n in names})
        raise UserError(f"{setting}: no parameter name starts with "
                        f"{', '.join(short(p) for p in unmatched)}; names look like "
                        f"{', '.join(names[:4])} (top level: {', '.join(tops[:8])})")
    frozen = 0
    for name, p in model.named_parameters():
        if any(name.startswith(pre) for pre in prefixes):
            p.requires_grad_(False)
            frozen += 1
    if frozen == len(names):
        raise UserError(f"{setting} freezes every parameter ({', '.join(map(short, prefixes))} "
                        f"cover all {len(names)}): nothing would train; leave the final layer "
                        f"(e.g. {names[-1] if names else '-'}) out")
    return frozen


def read_init_from(src: Path, setting: str) -> dict:
    """stages[i].init_from's state dict: a file (not a folder), readable, finite."""
    from ddpflow.engine import checkpoint

    existing(src, setting, "run the earlier stage first or fix the path")
    weights = checkpoint.load_weights(src, setting)
    check_finite(weights, f"{setting}: {src}")
    return weights


def check_init_from(model: nn.Module | None, src: Path, setting: str) -> None:
    """The launcher's check of an init_from file: readable, finite and (with a model on the
    meta device) fitting every tensor."""
    from ddpflow.engine import checkpoint

    sd = read_init_from(src, setting)
    if model is not None:
        checkpoint.check_fits(model, sd, f"{setting} {src}")


def start_weights(cfg, stage, model: nn.Module, src: Path | None, say) -> dict | None:
    """Load the stage's starting weights into `model` and freeze what the stage freezes.
    Returns what happened, for the log and summary.json."""
    i = cfg.stage_index(stage.name)
    report = None
    if src is not None and stage.init_from:
        from ddpflow.engine import checkpoint

        setting = f"stages.{i}.init_from"
        weights = read_init_from(src, setting)
        checkpoint.check_fits(model, weights, f"{setting} {src}")
        model.load_state_dict(weights)
        report = {"from": str(src), "loaded": len(weights), "skipped": 0, "reinitialised": []}
        say(f"initialised from {src}")
    elif src is not None:
        report = load_pretrained(model, read_state_dict(src, "model.weights"),
                                 f"model.weights {src}", cfg.model.weights_partial)
        report = {"from": str(src), **report}
        shown = ", ".join(report["reinitialised"][:4])
        say(f"model.weights {src}: {report['loaded']} tensors loaded, {report['skipped']} "
            f"not used, {len(report['reinitialised'])} re-initialised"
            + (f" ({shown})" if shown else "")
            + (" (model.weights_partial)" if report.get("partial") else ""))
    prefixes = stage.freeze if stage.freeze is not None else cfg.model.freeze
    setting = f"stages.{i}.freeze" if stage.freeze is not None else "model.freeze"
    frozen = freeze(model, prefixes, setting)
    if frozen:
        say(f"{frozen} parameter tensors frozen ({', '.join(prefixes)})")
    if report is not None or frozen:
        report = {**(report or {}), "frozen": frozen}
    return report
