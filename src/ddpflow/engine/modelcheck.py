"""What of a config's model can be refused when the config is read (`ddpflow validate`,
`sweep plan`), by the same checks `ddpflow launch` makes before its ranks start: the model
built on the meta device (no memory, no weights) through the seam (model.kwargs against its
builder), then each stage's blocks (`model.shard_blocks`, activation checkpointing, what
strategy fsdp shards: build.model_blocks). Before, a trial naming a class the model lacks
was planned, and failed at its start.

Only a config that needs it is built (model.kwargs set, or a stage that shards or
recomputes blocks): importing torch and torchvision costs validate seconds otherwise.
"""

from __future__ import annotations

from ddpflow.core.errors import UserError

# the class count and image channels of the built-in sources, for a build before any data
# is prepared (neither changes which blocks a model has)
SOURCE_SHAPES = {"cifar10": (10, 3), "cifar100": (100, 3), "mnist": (10, 1),
                 "fashion_mnist": (10, 1)}


def needs_model(cfg) -> bool:
    return bool(cfg.model.kwargs) or any(
        stage.strategy == "fsdp" or stage.activation_checkpointing for stage in cfg.stages)


def data_shape(cfg) -> tuple[int | None, int | None, bool]:
    """(classes, channels, known) of the config's data: meta.json's when prepared, else the
    source's; `known` False when they are a guess (an image folder not yet prepared)."""
    from ddpflow.data import prepared

    meta = prepared.read_meta(cfg.data_dir, damaged_ok=True)  # (prepare rebuilds a damaged one)
    if meta is not None:
        channels = meta.get("in_channels") if meta.get("kind") == "python" else \
            meta["image_shape"][2]
        return meta.get("num_classes"), channels, True
    source = cfg.data.source
    if source == "synthetic":
        return cfg.data.num_classes, 1 if cfg.data.grayscale else 3, True
    classes, channels = SOURCE_SHAPES.get(source, (2, 3))
    return classes, 1 if cfg.data.grayscale else channels, source in SOURCE_SHAPES


def check_model(cfg, seen: set | None = None) -> None:
    """The model of `cfg` built on the meta device and each stage's blocks found, as launch
    finds them: one UserError naming the key, or nothing. A builder that fails only on a
    guessed class count (data not prepared yet) is left to launch, which knows it. `seen`:
    what earlier calls checked (a sweep's trials that share a model are built once)."""
    if not needs_model(cfg):
        return
    d = cfg.to_dict()
    key = repr((d["model"], [d["data"][k] for k in ("source", "prepared_dir", "num_classes",
                                                    "grayscale")],
                [(s["strategy"], s["activation_checkpointing"]) for s in d["stages"]]))
    if seen is not None:
        if key in seen:
            return
        seen.add(key)
    import torch

    from ddpflow.core import lazydynamo
    from ddpflow.engine.build import model_blocks
    from ddpflow.seams.models import build_model, input_channels
    from ddpflow.seams.userimport import add_code_dirs

    lazydynamo.defer()  # nothing is compiled here
    add_code_dirs(cfg)
    classes, channels, known = data_shape(cfg)
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, classes, input_channels(cfg.model.name,
                                                                   channels or 3))
    except UserError as e:
        if known or str(e).startswith("model.kwargs."):
            raise
        return
    for st in cfg.stages:
        model_blocks(cfg, st, model)
