"""A model's blocks, and what is done to them: FSDP2 sharding (`strategy: fsdp`) and
activation checkpointing (`activation_checkpointing`), for DDP and FSDP alike.

The blocks are the model's repeated children: `model.shard_blocks` names their classes, else
they are found (the class whose groups of two or more same-class siblings hold the most
parameters; plain containers only when nothing else repeats, single layers last). FSDP then
shards each block apart and the root last (TorchTitan's order: activation checkpointing
first, then `fully_shard` per block, then the root), so a rank holds 1/world of every
parameter, gradient and optimizer state, and gathers one block's parameters at a time.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ddpflow.core.errors import UserError
from ddpflow.seams.models import count_text

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def repeated(model: nn.Module) -> dict[type, list[nn.Module]]:
    """Module class -> its instances that have a sibling of the same class (and parameters):
    a model's repeated children."""
    found: dict[type, list[nn.Module]] = defaultdict(list)
    for parent in model.modules():
        groups: dict[type, list[nn.Module]] = defaultdict(list)
        for child in parent.children():
            if _params(child):
                groups[type(child)].append(child)
        for cls, members in groups.items():
            if len(members) > 1:
                found[cls].extend(members)
    return found


def _tier(cls: type, members: list[nn.Module]) -> int:
    """0: a real block (a class with children of its own); 1: a plain container; 2: a layer."""
    if not any(True for _ in members[0].children()):
        return 2
    return 1 if cls in CONTAINERS else 0


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """Those not inside another of `modules`, in the model's order."""
    inner = {id(c) for m in modules for c in m.modules() if c is not m}
    return [m for m in modules if id(m) not in inner]


def find_blocks(model: nn.Module, names: tuple[str, ...] | None, model_name: str,
                setting: str = "model.shard_blocks") -> list[nn.Module]:
    """The model's blocks: instances of the classes `names` (class names), else found.
    Named: the repeated ones where a class also wraps them (smallcnn's Sequential blocks,
    not the Sequential around them), else the outermost; a name that is no class of the
    model's modules, the model itself or a class without parameters is a UserError."""
    if not names:
        found = repeated(model)
        if not found:
            return []
        cls = min(found, key=lambda c: (_tier(c, found[c]), -sum(map(_params, found[c]))))
        return _outermost(found[cls])
    for name in names:
        _check_name(model, name, model_name, setting)
    reps = {id(m) for members in repeated(model).values() for m in members}
    named = [m for m in model.modules() if m is not model and type(m).__name__ in names
             and _params(m)]
    kept = [m for m in named if id(m) in reps] or named
    return _outermost(kept)


def _check_name(model: nn.Module, name: str, model_name: str, setting: str) -> None:
    found = [m for m in model.modules() if m is not model and type(m).__name__ == name]
    null = "true" if setting.endswith("activation_checkpointing") else "null"
    if found and any(_params(m) for m in found):
        return
    if found:
        why = "has no parameters: it is a layer, not a block"
    elif name == type(model).__name__:
        why = "is the model itself, not one of its blocks"
    else:
        close = sorted({type(m).__name__ for m in model.modules()
                        if type(m).__name__.casefold() == name.casefold()})
        why = ("is not the class of any module of the model" +
               (f" (did you mean '{close[0]}'?)" if close else ""))
    raise UserError(f"{setting}: '{name}' {why}; model {model_name} has {describe(model)}; "
                    f"name one of those classes (or {null}: found in the model)")


def describe(model: nn.Module) -> str:
    """'repeated blocks BasicBlock (8), ...' for a message."""
    found = repeated(model)
    if not found:
        return f"no repeated blocks ({count_text(_params(model))} parameters)"
    ranked = sorted(found, key=lambda c: (_tier(c, found[c]), -sum(map(_params, found[c]))))
    return "repeated blocks " + ", ".join(
        f"{c.__name__} ({len(_outermost(found[c]))})" for c in ranked[:5])


def shared_parameter(model: nn.Module, blocks: list[nn.Module]) -> str | None:
    """The name of a parameter that a block shares with another block or with the rest of
    the model (tied weights), or None. FSDP shards each block apart: a tied parameter would
    belong to two units."""
    index = {id(b): i for i, b in enumerate(blocks)}
    unit: dict[str, int] = {}  # module path -> its block (-1: the root's unit)
    first: dict[int, int] = {}  # parameter -> the unit it was met in first
    for name, m in model.named_modules(remove_duplicate=False):  # parents first
        parent = unit.get(name.rpartition(".")[0], -1) if name else -1
        unit[name] = index.get(id(m), parent) if parent == -1 else parent
        for pname, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if first.setdefault(id(p), unit[name]) != unit[name]:
                return f"{name}.{pname}" if name else pname
    return None


# ---------------------------------------------------------------- activation checkpointing
_CHECKPOINTED: dict[type, type] = {}


class Measure:
    """While `on`, every checkpointed block also measures what it would have kept for the
    backward without checkpointing (one extra forward of the block, its buffers and RNG
    put back): the memory activation checkpointing saves, for summary.json. `kept`: those
    tensors' storages (SavedBytes' keys; a block's inputs and outputs under the real ones',
    so that what the rest of the model keeps of them too counts once) -> bytes."""
    on = False
    kept: dict = {}


def _checkpointed_class(cls: type) -> type:
    """`cls` with its forward run under torch.utils.checkpoint (non-reentrant: works with
    DDP and FSDP, keeps the RNG so dropout repeats in the recompute). A
    subclass, so parameter names, state dicts and deepcopies stay as they were."""
    if cls not in _CHECKPOINTED:
        def forward(self, *args, **kwargs):
            def run():
                return checkpoint(super(new, self).forward, *args, use_reentrant=False,
                                  context_fn=lambda: (nullcontext(), _KeptBuffers(self)),
                                  **kwargs)
            if not Measure.on:
                return run()
            # checkpoint saves the block's inputs for its recompute: counted as the block's
            # inputs (block_inputs), not among what the rest of the model saved
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                out = run()
            Measure.kept.update(_uncheckpointed(super(new, self).forward, self, args, kwargs,
                                                out))
            return out
        new = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[cls] = new
    return _CHECKPOINTED[cls]


class _KeptBuffers:
    """The recompute in the backward leaves the block's buffers as the forward left them:
    BatchNorm's running statistics are updated once per micro-batch, not twice."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self):
        self.saved = [b.clone() for b in self.module.buffers()]

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, kept in zip(self.module.buffers(), self.saved):
                b.copy_(kept)


def _same(t):
    return t


_MEASURES = itertools.count()  # tells apart the inner tensors of one measure from another's


def _uncheckpointed(fn, module: nn.Module, args, kwargs, out) -> dict:
    """What the block's forward keeps for the backward without checkpointing: storage key ->
    bytes. Its inputs (detached: the same storages) under their own keys, its outputs under
    the real outputs' (`out`), its inner tensors under keys of this measure alone (their
    memory is freed here and reused by the next one)."""
    buffers = [b.clone() for b in module.buffers()]
    counted = SavedBytes()
    devices = [a.device for a in args if torch.is_tensor(a) and a.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices), counted, torch.enable_grad():
        again = fn(*[a.detach() if torch.is_tensor(a) else a for a in args], **kwargs)
    for b, saved in zip(module.buffers(), buffers):
        b.copy_(saved)  # BatchNorm's running statistics as if the measure never ran
    inputs = {storage_key(a) for a in args if torch.is_tensor(a)}
    outputs = {storage_key(a): storage_key(b) for a, b in zip(tree_leaves(again),
                                                               tree_leaves(out))
               if torch.is_tensor(a) and torch.is_tensor(b)}
    this = next(_MEASURES)
    return {key if key in inputs else outputs.get(key, (this, key)): n
            for key, n in counted.kept.items()}


def class_name(m: nn.Module) -> str:
    """The model's own class name of a block (FSDP and checkpointing subclass it)."""
    return type(m).__name__.removeprefix("FSDP").removeprefix("Checkpointed")


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    for b in blocks:
        b.__class__ = _checkpointed_class(type(b))


def storage_key(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.device


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """What autograd keeps for the backward while active: `kept`, each storage once (its key
    -> bytes), parameters left out (they are held anyway: counted as parameters)."""

    def __init__(self):
        self.kept: dict = {}

        def pack(t):
            base = t if t._base is None else t._base  # a weight's transpose is a view
            if base.is_leaf and base.requires_grad:  # a parameter (FSDP: a gathered one)
                return t
            if t.untyped_storage().data_ptr():
                self.kept.setdefault(storage_key(t), t.untyped_storage().nbytes())
            return t
        super().__init__(pack, _same)

    @property
    def bytes(self) -> int:
        return sum(self.kept.values())


def block_inputs(blocks: list[nn.Module]):
    """Forward pre-hooks that note checkpointed blocks' tensor inputs (what checkpointing
    keeps of a block: storage key -> bytes), and their handles' remover."""
    kept: dict = {}

    def hook(_m, args):
        kept.update((storage_key(a), a.untyped_storage().nbytes()) for a in args
                    if torch.is_tensor(a) and a.untyped_storage().data_ptr())
    handles = [b.register_forward_pre_hook(hook) for b in blocks]
    return kept, lambda: [h.remove() for h in handles]


# ---------------------------------------------------------------- FSDP
def fsdp_policy(model: nn.Module, precision: str):
    """FSDP's mixed precision: fp32 master weights and gradient reduction; parameters
    gathered in the stage's bf16 for compute, except in a model with BatchNorm (its fp32
    running statistics need fp32 weights): there autocast alone lowers each op's precision.
    Returns (policy, what it does, for the log)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if amp is not None and any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                               for m in model.modules()):
        return (MixedPrecisionPolicy(reduce_dtype=torch.float32),
                f"fp32 parameters gathered (BatchNorm), {precision} autocast")
    return (MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32),
            f"{precision} parameters gathered, fp32 gradient reduction and master weights")


def shard(model: nn.Module, blocks: list[nn.Module], precision: str,
          reshard_after_forward: bool) -> str:
    """FSDP2 on each block, then on the root (in place: `model` becomes an FSDPModule).
    Returns how, for the log."""
    from torch.distributed.fsdp import fully_shard

    policy, how = fsdp_policy(model, precision)
    names = sorted({class_name(b) for b in blocks})
    for b in blocks:
        fully_shard(b, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the root's parameters (stem, head) are needed first in the backward: kept gathered
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return f"{len(blocks)} {'/'.join(names)} blocks + root sharded, {how}"
