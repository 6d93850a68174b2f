"""`ddpflow export`: a stage's weights as a bundle that runs without ddpflow's config.

    results/<run>/export/
        model.safetensors   the state dict (load into the architecture named in model.json)
        model.ts            TorchScript (torch.jit.load: no model code needed)
        model.onnx          ONNX, dynamic batch (opset in model.json)
        model.json          architecture, classes, image size, mean/std, the crop rule,
                            SHA-256 and size of each file, and each format's check

Each format is checked when it is written: on a batch of real validation images its
outputs are compared with the PyTorch model's (max |difference| of the logits within a
tolerance, and the same top-1 class). Where a GPU exists the TorchScript file also runs
there (a trace on the CPU bakes the device of tensors made in `forward` into it); the
check's `checked_on` in model.json names where each file ran. A format that cannot be
written or checked is named with its reason in model.json and on stderr, the others are
still written, and the command exits 1. The bundle is built in a folder beside the target
and moved into place whole, model.json last: a bundle without model.json is never
complete. An existing target is replaced only when it is empty or an earlier bundle
(core/writing.py): a folder of other files, a file or a link is refused, untouched, before
any work.
"""

from __future__ import annotations

import os
import sys
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ddpflow import __version__
from ddpflow.config import Config
from ddpflow.core import reading, writing
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.core.nativewrite import native_writer, need_bytes
from ddpflow.data import crops, prepared
from ddpflow.data.prepare import check_settings
from ddpflow.inference.common import preprocess, stage_model, warn_if_stale
from ddpflow.seams.models import input_channels

OPSET = 17
CHECK_IMAGES = 32  # validation images the formats are checked on
RTOL = 1e-4  # a format passes when max |logit difference| <= RTOL x max(1, max |logit|)
UMASK = os.umask(0o022)
os.umask(UMASK)  # (read by setting it: restored at once)
FILES = {"safetensors": "model.safetensors", "torchscript": "model.ts", "onnx": "model.onnx"}

_SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_NUMBERS = {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}
# model.json as `ddpflow predict` reads it (reading.py validates it before any field is
# used): first what every bundle has, then what a classification bundle must have
MANIFEST_SCHEMA = {
    "type": "object", "required": ["format_version", "task"],
    "properties": {"format_version": {"const": 1}, "task": {"type": "string"}}}
CLASSIFIER_SCHEMA = {
    "type": "object",
    "required": ["files", "num_classes", "classes", "input", "image_size", "store_size",
                 "grayscale", "mean", "std"],
    "properties": {
        "files": {"type": "object", "minProperties": 1,
                  "propertyNames": {"enum": sorted(FILES)},
                  "additionalProperties": {
                      "type": "object", "required": ["file", "sha256"],
                      # a name ddpflow wrote: one line, within a file name's limit
                      "properties": {"file": {"type": "string", "minLength": 1,
                                              "maxLength": 255,
                                              "pattern": "^[^\\x00-\\x1f\\x7f]+$"},
                                     "sha256": _SHA256}}},
        "num_classes": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "classes": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "input": {"type": "object", "required": ["channels"],
                  "properties": {"channels": {"type": "integer", "minimum": 1,
                                              "maximum": 4}}},
        "image_size": {"type": "integer", "minimum": 1, "maximum": 8192},
        "store_size": {"type": "integer", "minimum": 1, "maximum": 8192},
        "grayscale": {"type": "boolean"},
        "eval_crop": {"type": "object", "required": ["crop"], "properties": {
            "crop": {"type": "integer", "minimum": 1, "maximum": 8192},
            "resize": {"type": ["integer", "null"], "minimum": 1, "maximum": 8192},
            "interpolation": {"enum": ["bilinear", "bicubic"]}}},
        "mean": _NUMBERS,
        "std": {**_NUMBERS, "items": {"type": "number", "exclusiveMinimum": 0}}}}


def export(cfg: Config, stage: str | None = None, out: str | None = None,
           weights: str = "final") -> int:
    """The bundle of a stage's `weights` (final, best, ema or raw: as evaluate's --weights)."""
    stage = stage or cfg.stages[-1].name
    meta = prepared.read_meta(cfg.data_dir)
    if meta is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare` first")
    check_settings(cfg, meta)
    warn_if_stale(cfg, stage)
    target = Path(out) if out else cfg.run_dir / "export"
    legacy = partial(is_bundle, strict=out is not None)
    writing.check_replaceable(target, WHAT, legacy)  # before the work, and again at the end
    model, record = stage_model(cfg, meta, stage, weights)
    channels = input_channels(cfg.model.name, meta["image_shape"][2])
    x = _check_batch(cfg, meta, channels)
    with torch.no_grad():
        ref = model(x)
    spec: dict = {}

    def build(folder: Path) -> dict:
        # the whole bundle's space first (each writer checks its own again): no work is done
        # for a bundle that cannot fit
        writing.require_free_space(folder, need_bytes(len(FILES) * weights_bytes(model)), WHAT)
        checks = {fmt: _write_format(fmt, model, x, ref, folder / name)
                  for fmt, name in FILES.items()}
        spec.update(_spec(cfg, meta, record, channels, checks, folder))
        writing.write_json_atomic(folder / "model.json", spec)
        for f in folder.iterdir():  # a bundle is handed on: readable by others (umask)
            os.chmod(f, 0o666 & ~UMASK)
        os.chmod(folder, 0o777 & ~UMASK)
        return spec

    writing.build_folder(target, build, WHAT, legacy=legacy)
    failed = {f: c["error"] for f, c in spec["checks"].items() if not c["ok"]}
    for fmt, c in spec["checks"].items():
        state = "ok" if c["ok"] else f"FAILED: {c['error']}"
        print(f"  {fmt:12s} {FILES[fmt]:18s} {state}"
              + (f" (max |diff| {c['max_abs_diff']:.2e})" if c.get("max_abs_diff") is not None
                 else "") + (f", run on {' and '.join(c['checked_on'])}" if c.get("checked_on")
                             else ""))
    print(f"ddpflow: exported stage '{stage}' ({weights}: {record['holds']} weights, step "
          f"{record['step']}) -> {target}")
    if failed:
        print("ddpflow: error: " + "; ".join(f"{f} was not exported: {e}"
                                             for f, e in failed.items()), file=sys.stderr)
        return 1
    return 0


WHAT = "the export bundle"


def is_bundle(folder: Path, strict: bool = True) -> bool:
    """A bundle of a version before the `.ddpflow-output` marker: nothing but the files
    export writes, and ddpflow's model.json; in ddpflow's own place (no --out, `strict`
    False) also without model.json (Snakemake deletes it before a job that remakes it)."""
    if not set(os.listdir(folder)) <= {"model.json", *FILES.values()}:
        return False
    if not (folder / "model.json").exists():
        return not strict
    return reading.read_json_or_none(folder / "model.json", {
        "type": "object", "required": ["ddpflow", "files"]}, "model.json") is not None


def weights_bytes(model) -> int:
    """Bytes of the model's tensors: what each format's file holds once."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _check_batch(cfg: Config, meta: dict, channels: int) -> torch.Tensor:
    """Up to CHECK_IMAGES validation images (the training split if val is empty), as the
    model sees them."""
    _, arrays = prepared.load(cfg.data_dir)
    images = arrays["val"][0] if len(arrays["val"][0]) else arrays["train"][0]
    pre = preprocess(meta["mean"], meta["std"], cfg.data.image_size, channels,
                     torch.device("cpu"), crops.eval_sizes(cfg.data))
    return pre(torch.from_numpy(np.array(images[:CHECK_IMAGES])))


def _write_format(fmt: str, model, x, ref, path: Path) -> dict:
    """Write one format and check it against `ref`; {"ok", "error", figures}."""
    try:
        # each writer is C++ (TorchScript's aborts the process on a full disk): the space it
        # needs is checked first, its errors of the place are one message (nativewrite.py)
        with warnings.catch_warnings(), native_writer(path, WHAT, weights_bytes(model)):
            warnings.simplefilter("ignore")  # tracer and exporter chatter, not the user's
            out = WRITERS[fmt](model, x, path)
    except Exception as e:  # noqa: BLE001 - a tracer/exporter failure is reported per format
        path.unlink(missing_ok=True)
        if isinstance(e, OSError) and writing.user_os_error(e, path, WHAT) or isinstance(
                e, UserError):
            raise  # a full disk, not the format's fault: build_folder names the target
        return {"ok": False, "checked_on": checked_on(fmt),
                "error": str(e) if isinstance(e, DeviceCheckError) else
                f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    if out is None:  # written, but nothing here can run it
        return {"ok": True, "checked": False, "checked_on": [],
                "note": "onnxruntime is not installed: not run (pip install onnxruntime)"}
    diff = (out.float() - ref.float()).abs().max().item()
    tol = RTOL * max(1.0, ref.abs().max().item())
    same_top1 = bool((out.argmax(1) == ref.argmax(1)).all())
    ok = diff <= tol and same_top1
    return {"ok": ok, "checked": True, "checked_on": checked_on(fmt), "images": len(x),
            "max_abs_diff": diff,
            "tolerance": tol, "same_top1": same_top1,
            "error": None if ok else f"outputs differ from the PyTorch model's by {diff:.2e} "
                                     f"(tolerance {tol:.2e}, same top-1: {same_top1})"}


def _safetensors(model, x, path: Path):
    from safetensors.torch import load_model, save_model

    save_model(model, str(path))
    twin = _fresh_copy(model)
    load_model(twin, str(path))
    with torch.no_grad():
        return twin(x)


def _fresh_copy(model):
    import copy

    twin = copy.deepcopy(model)
    for p in twin.state_dict().values():
        p.zero_()  # the check proves the file holds the weights
    return twin.eval()


def _torchscript(model, x, path: Path):
    """Traced on the CPU, loaded back and run on the CPU; where a GPU exists also on it
    (`_on_cuda`): a trace bakes the device of tensors that `forward` creates into the file,
    and such a file fails or differs there only."""
    traced = torch.jit.trace(model, x[:2], check_trace=False)
    traced.save(str(path))
    loaded = torch.jit.load(str(path), map_location="cpu")
    with torch.no_grad():
        out = loaded(x)  # another batch size than traced with: the batch is dynamic
    if torch.cuda.is_available():
        _on_cuda(path, x, out)
    return out


class DeviceCheckError(RuntimeError):
    """The TorchScript file fails, or gives other outputs, on the GPU."""


def _on_cuda(path: Path, x, ref, device: str = "cuda") -> None:
    """The saved TorchScript file on `device` (a GPU; written for one, unverified on a CPU
    machine: bench/gpu.sh exports a model that creates a tensor in `forward` there): the
    same outputs as on the CPU, or DeviceCheckError naming the device."""
    try:
        gpu = torch.jit.load(str(path), map_location=device)
        with torch.no_grad():
            out = gpu(x.to(device)).float().cpu()
    except Exception as e:  # noqa: BLE001 - a device baked into the trace: any error
        raise DeviceCheckError(f"the TorchScript file fails on {device} (traced on the CPU; a "
                               f"tensor made in forward keeps the CPU device?): "
                               f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
    diff = (out - ref.float()).abs().max().item()
    if diff > RTOL * max(1.0, ref.abs().max().item()) * 100:  # GPU kernels: TF32 and others
        raise DeviceCheckError(f"the TorchScript file gives other outputs on {device} than "
                               f"on the CPU (max |diff| {diff:.2e})")


def checked_on(fmt: str) -> list[str]:
    """Where a format's file is run at export: TorchScript also on the GPU when one exists
    (what `predict --device cuda` will load); ONNX on onnxruntime's CPU provider."""
    return ["cpu", "cuda"] if fmt == "torchscript" and torch.cuda.is_available() else ["cpu"]


def _onnx(model, x, path: Path):
    try:
        import onnx  # noqa: F401 - the exporter needs it
    except ImportError:
        raise RuntimeError("the onnx package is not installed (pip install onnx)") from None
    torch.onnx.export(model, (x[:2],), str(path), dynamo=False, opset_version=OPSET,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"input": x.numpy()})[0])


WRITERS = {"safetensors": _safetensors, "torchscript": _torchscript, "onnx": _onnx}


def _spec(cfg: Config, meta: dict, record: dict, channels: int, checks: dict,
          folder: Path) -> dict:
    crop = crops.eval_sizes(cfg.data)  # what predict repeats (eval_crop)
    files = {fmt: {"file": name, "sha256": sha256_of(folder / name),
                   "bytes": (folder / name).stat().st_size}
             for fmt, name in FILES.items() if (folder / name).is_file()}
    return {
        "format_version": 1, "ddpflow": __version__, "torch": torch.__version__,
        "architecture": {"name": cfg.model.name, "kwargs": cfg.model.kwargs,
                         "code_dir": cfg.model.code_dir},
        "task": cfg.task.name, "num_classes": meta["num_classes"], "classes": meta["classes"],
        "input": {"name": "input", "layout": "NCHW", "dtype": "float32",
                  "channels": channels, "data_channels": meta["image_shape"][2]},
        "image_size": cfg.data.image_size, "store_size": cfg.data.store_size,
        "grayscale": meta["image_shape"][2] == 1, "mean": meta["mean"], "std": meta["std"],
        "crop": {"decode": f"RGB (or L when grayscale), short side resized to "
                           f"{cfg.data.store_size} (bilinear), centre square kept",
                 "normalize": "(x / 255 - mean) / std per channel",
                 "eval": crops.eval_sizes(cfg.data).describe()},
        "eval_crop": {"crop": crop.crop, "resize": crop.resize, "interpolation": crop.mode},
        "onnx_opset": OPSET, "files": files, "checks": checks,
        "check_rule": f"max |logit difference| <= {RTOL:g} x max(1, max |logit|) and the "
                      f"same top-1 class, on {CHECK_IMAGES} validation images",
        "source": record, "config_hash": cfg.hash,
        "stage_hash": cfg.stage_hash(record["stage"]),
    }
