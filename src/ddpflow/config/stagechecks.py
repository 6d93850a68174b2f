"""Checks of the stage list, of each stage's recipe and of the data's (sampling,
augmentation policy, evaluation crop) that span several keys (the schema checks one key at
a time): each mistake is one `invalid config: <key>: ...` message naming the key and what
to write instead.

A stage's name becomes a folder (results/<run>/stages/<name>/) and a Snakemake wildcard:
the schema's pattern keeps it to letters, digits, '.', '_' and '-' starting with a letter or
digit (no '/', '..', spaces or leading '-'); here, two names that differ only in case are
refused too, since they share one folder on a case-insensitive filesystem (macOS, Windows).
"""

from __future__ import annotations

from typing import Any

from ddpflow.core.errors import UserError


def check_stages(d: dict[str, Any]) -> None:
    """Unique names (also after case-folding), profile.stage and init_from."""
    names = [s["name"] for s in d["stages"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"invalid config: stages: stage names must be unique, repeated: "
                        f"{', '.join(dupes)}; rename one of them")
    seen: dict[str, str] = {}
    for n in names:
        other = seen.setdefault(n.casefold(), n)
        if other != n:
            raise UserError(f"invalid config: stages: stage names '{other}' and '{n}' differ "
                            f"only in case, and would share one folder on a case-insensitive "
                            f"filesystem (macOS, Windows); rename one of them")
    if d["profile"]["stage"] is not None and d["profile"]["stage"] not in names:
        raise UserError(f"invalid config: profile.stage '{d['profile']['stage']}' is not a "
                        f"stage; stages are: {', '.join(names)}")
    for i, st in enumerate(d["stages"]):
        _check_init_from(i, st.get("init_from"), names)


def _check_init_from(i: int, init: str | None, names: list[str]) -> None:
    key = f"invalid config: stages.{i}.init_from"
    if init == "previous" and i == 0:
        raise UserError(f"{key}: the first stage has no previous stage; use null or a path "
                        f"to weights")
    if isinstance(init, str) and init != "previous" and init.casefold() == "previous":
        raise UserError(f"{key}: '{init}' is read as a file name; write previous (lower "
                        f"case) to start from the stage before, or ./{init} for a file")
    if init not in names:  # null, previous, or a path to a weights file
        return
    j = names.index(init)
    if j == i:
        why = ("is this very stage, which cannot start from its own result: use previous, "
               "null or a path to weights")
    elif j > i:
        why = (f"runs after this one (stage {j}), so it has no weights yet: move it before "
               f"this stage, or use previous, null or a path to weights")
    elif j == i - 1:
        why = "is the stage just before: write init_from: previous"
    else:
        why = (f"is an earlier stage; init_from takes previous or a path to a weights file: "
               f"give that stage's final.pt, or ./{init} for a file of that name")
    raise UserError(f"{key}: '{init}' names a stage; stage '{init}' {why}")


def check_stage_recipe(d: dict[str, Any]) -> None:
    """Per stage: progressive resizing ends at data.image_size and grows; warm-up fits
    in the stage's epochs."""
    size = d["data"]["image_size"]
    for i, st in enumerate(d["stages"]):
        key = f"invalid config: stages.{i}"
        pr = st["progressive_resize"]
        if pr:
            start, end = pr["start_size"], pr["end_size"]
            if end != size:
                raise UserError(f"{key}.progressive_resize.end_size: {end} is not "
                                f"data.image_size {size}; the last epochs train at the size "
                                f"validation, evaluate and export use: set end_size: {size}")
            if start > end:
                raise UserError(f"{key}.progressive_resize.start_size: {start} is larger than "
                                f"end_size {end}; progressive resizing grows the images: set "
                                f"start_size <= {end}")
            if start < end and st["epochs"] < 2:
                raise UserError(f"{key}.progressive_resize: a stage of 1 epoch trains at "
                                f"start_size {start} only and never reaches {end}; set "
                                f"stages.{i}.epochs >= 2, or drop progressive_resize")
        _check_strategy(key, st)
        _check_schedule(key, st)
        if st["warmup_epochs"] > st["epochs"]:
            raise UserError(f"{key}.warmup_epochs: {st['warmup_epochs']} is more than the "
                            f"stage's {st['epochs']} epoch(s); the learning rate would never "
                            f"reach lr: set warmup_epochs <= {st['epochs']}")


FSDP_FP16 = ("fp16 does not go with strategy fsdp (the GradScaler would skip steps on some "
             "ranks only)")


def check_precision(key: str, strategy: str, precision: str, auto: bool = False) -> None:
    """The one check of a precision against the strategy: at validation for what the config
    says, and again where `precision: auto` is resolved on the device (engine/settings.py)."""
    if strategy == "fsdp" and precision == "fp16":
        picked = " (what precision auto picks on a GPU without native bf16)" if auto else ""
        raise UserError(f"{key}.precision: {FSDP_FP16}{picked}; set precision: bf16 or fp32, "
                        f"or strategy: ddp")


def _check_strategy(key: str, st: dict) -> None:
    """What strategy fsdp does not go with, and its own key under another strategy."""
    if st["strategy"] != "fsdp":
        if not st["reshard_after_forward"]:
            raise UserError(f"{key}.reshard_after_forward: false is a setting of strategy "
                            f"fsdp, and this stage's strategy is {st['strategy']}; drop it, "
                            f"or set strategy: fsdp")
        return
    clashes = [  # (set?, key, why not, what to set instead)
        (st["ema"]["decay"] is not None, "ema", "an EMA of the weights is not kept under "
         "strategy fsdp (each rank holds a shard of them)", "set ema.decay: null"),
        (st["compile"], "compile", "torch.compile is not offered with strategy fsdp yet",
         "set compile: false"),
        (st["channels_last"] is True, "channels_last", "true does not go with strategy fsdp "
         "(FSDP2 shards contiguous parameters only)",
         "set channels_last: false or auto (off under fsdp)")]
    for clash, name, why, fix in clashes:
        if clash:
            raise UserError(f"{key}.{name}: {why}; {fix}, or strategy: ddp")
    check_precision(key, st["strategy"], st["precision"])


def _check_schedule(key: str, st: dict) -> None:
    """Each schedule's own keys: set where it reads them, and only there."""
    kind = st["schedule"]
    if kind == "step" and st["lr_step_epochs"] is None:
        raise UserError(f"{key}.lr_step_epochs: schedule step multiplies the learning rate by "
                        f"lr_gamma every lr_step_epochs epochs; set it (e.g. 30)")
    if kind != "step" and st["lr_step_epochs"] is not None:
        raise UserError(f"{key}.lr_step_epochs is a setting of schedule step, and this "
                        f"stage's schedule is {kind}; drop it, or set schedule: step")
    ms = st["lr_milestones"]
    if kind == "multistep" and not ms:
        raise UserError(f"{key}.lr_milestones: schedule multistep multiplies the learning "
                        f"rate by lr_gamma at each of these epochs; list them, e.g. [30, 60]")
    if kind != "multistep" and ms:
        raise UserError(f"{key}.lr_milestones is a setting of schedule multistep, and this "
                        f"stage's schedule is {kind}; drop it, or set schedule: multistep")
    if any(b <= a for a, b in zip(ms, ms[1:])):
        raise UserError(f"{key}.lr_milestones {ms}: each epoch once, in increasing order")
    if ms and st["max_steps"] is None and ms[-1] >= st["epochs"]:
        raise UserError(f"{key}.lr_milestones: epoch {ms[-1]} is not inside the stage's "
                        f"{st['epochs']} epoch(s), so that decay never comes; list epochs "
                        f"below {st['epochs']}")
    if st["lr_min"] and kind not in ("cosine", "linear"):
        raise UserError(f"{key}.lr_min is where a cosine or linear schedule ends, and this "
                        f"stage's schedule is {kind}; drop it, or set schedule: cosine")
    if st["lr_min"] >= st["lr"]:
        raise UserError(f"{key}.lr_min {st['lr_min']:g} is not below lr {st['lr']:g}; the "
                        f"schedule decays from lr down to lr_min: set lr_min < lr")


POLICY_KEYS = {"num_ops": ("randaugment",), "magnitude": ("randaugment", "augmix")}


def check_data_recipe(d: dict[str, Any]) -> None:
    """data.sampling with its weights and task, the augmentation policy's own keys, and
    the evaluation crop inside the image it resizes."""
    data, aug = d["data"], d["data"]["augment"]
    mode, spec = data["sampling"], data["sample_weights"]
    if mode == "weights" and spec is None:
        raise UserError("invalid config: data.sampling weights draws each sample by its "
                        "weight, and data.sample_weights is null; set it to "
                        "package.module:callable(labels) returning one weight per sample")
    if mode != "weights" and spec is not None:
        raise UserError(f"invalid config: data.sample_weights is read by data.sampling "
                        f"weights only, and data.sampling is {mode}; set sampling: weights, "
                        f"or drop sample_weights")
    if mode == "balanced" and d["task"]["name"] == "regression":
        raise UserError("invalid config: data.sampling balanced draws each class equally "
                        "often, and task regression has no classes; use data.sampling "
                        "uniform, or weights (data.sample_weights)")
    python = data["source"] == "python" and not data["materialize"]
    used = [k for k in ("policy", "eval_resize_size", "eval_crop_size")
            if (aug if k == "policy" else data)[k] is not None]
    if python and used:
        where = "augment." * (used[0] == "policy")
        raise UserError(f"invalid config: data.{where}{used[0]} acts on prepared images; a "
                        f"data.source python dataset does its own transforms (or set "
                        f"data.materialize: true)")
    for name, policies in POLICY_KEYS.items():
        if aug[name] is not None and aug["policy"] not in policies:
            raise UserError(f"invalid config: data.augment.{name} is a setting of policy "
                            f"{' and '.join(policies)}, and data.augment.policy is "
                            f"{aug['policy'] or 'null'}; drop it, or set the policy")
    if aug["policy"] == "augmix" and aug["magnitude"] is not None \
            and not 1 <= aug["magnitude"] <= 10:
        raise UserError(f"invalid config: data.augment.magnitude {aug['magnitude']} is "
                        f"AugMix's severity, from 1 to 10; set it in that range (3 is "
                        f"torchvision's default)")
    crop = data["eval_crop_size"] or data["image_size"]
    if data["eval_resize_size"] is not None and data["eval_resize_size"] < crop:
        raise UserError(f"invalid config: data.eval_resize_size {data['eval_resize_size']} is "
                        f"smaller than the centre crop it is cut from ({crop}: "
                        f"data.eval_crop_size or image_size); set it >= {crop}")
