"""`ddpflow predict`: an export bundle on image files, no training config needed.

Images of any size and mode are read exactly like validation (inference.py), run through
the bundle's TorchScript model (or ONNX with onnxruntime), batched, on the GPU when there
is one, and written as a CSV: path (as given; files found in a folder are the folder
joined with their relative path), class (top-1 name), prob, then class_2, prob_2, ... up
to --top-k, and error (why an unreadable image has no prediction).
"""

from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.inference.common import decode, image_files, preprocess

BATCH = 64  # images per forward


def load_bundle(folder: str | Path) -> dict:
    """model.json of an export bundle, every listed file checked against its SHA-256."""
    folder = Path(folder)
    try:
        spec = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{folder} is not an export bundle: model.json cannot be read ({e}); "
                        f"make one with `ddpflow export --config ...`") from None
    if not isinstance(spec, dict) or spec.get("format_version") != 1:
        raise UserError(f"{folder}/model.json is not a ddpflow export (format_version 1)")
    if spec.get("task") != "classification":
        raise UserError(f"{folder} holds a {spec.get('task')} model; predict writes classes "
                        f"and probabilities, which only a classification model gives (load "
                        f"model.ts or model.onnx yourself for its raw outputs)")
    for fmt, f in spec["files"].items():
        path = folder / f["file"]
        if not path.is_file():
            raise UserError(f"the bundle {folder} lacks {f['file']} ({fmt}) that model.json "
                            f"lists; export again")
        if sha256_of(path) != f["sha256"]:
            raise UserError(f"{path} does not match its SHA-256 in model.json (changed or "
                            f"damaged since export); export again")
    return spec


def _runner(spec: dict, folder: Path, fmt: str, device: torch.device):
    """(inputs float NCHW on device) -> logits, from the bundle's TorchScript or ONNX file."""
    files = spec["files"]
    if fmt == "auto":
        fmt = "torchscript" if "torchscript" in files else "onnx"
    if fmt not in files:
        raise UserError(f"the bundle has no {fmt} model (it has: {', '.join(files)})")
    path = str(folder / files[fmt]["file"])
    if fmt == "torchscript":
        with warnings.catch_warnings():  # "deprecated in favour of torch.export": still works
            warnings.simplefilter("ignore", FutureWarning)
            model = torch.jit.load(path, map_location=device).eval()
        return lambda x: model(x)
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("--format onnx needs onnxruntime: pip install onnxruntime") from None
    providers = (["CUDAExecutionProvider"] if device.type == "cuda" else []) + [
        "CPUExecutionProvider"]
    session = ort.InferenceSession(path, providers=providers)
    return lambda x: torch.from_numpy(session.run(None, {"input": x.cpu().numpy()})[0])


def predict(bundle: str, inputs: list[str], out: str, top_k: int = 5, fmt: str = "auto",
            device: str = "auto") -> int:
    folder = Path(bundle)
    spec = load_bundle(folder)
    if device not in ("auto", "cpu", "cuda") or (device == "cuda" and
                                                 not torch.cuda.is_available()):
        raise UserError(f"--device {device}: use auto, cpu or cuda (cuda needs a visible GPU)")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    run = _runner(spec, folder, fmt, dev)
    files = image_files(inputs)
    k = max(1, min(top_k, spec["num_classes"]))
    pre = preprocess(spec["mean"], spec["std"], spec["image_size"], spec["input"]["channels"],
                     dev)
    classes = spec["classes"]
    header = ["path", "class", "prob"] + [f"{c}_{i}" for i in range(2, k + 1)
                                          for c in ("class", "prob")] + ["error"]
    rows, bad_count = [], 0
    with tqdm(total=len(files), desc="predict", unit="img", file=sys.stderr,
              disable=None) as bar, torch.no_grad():
        for i in range(0, len(files), BATCH):
            chunk = files[i:i + BATCH]
            x, kept, bad = decode(chunk, spec["store_size"], spec["grayscale"])
            top = None
            if kept:
                probs = torch.softmax(run(pre(torch.from_numpy(x))).float(), 1).cpu()
                top = probs.topk(k, 1)
            found = dict(zip(kept, range(len(kept))))
            for j, path in enumerate(chunk):
                if j in bad:
                    rows.append([path] + [""] * (2 * k) + [bad[j]])
                    continue
                p, c = top.values[found[j]].tolist(), top.indices[found[j]].tolist()
                rows.append([path] + [v for n in range(k) for v in (classes[c[n]],
                                                                     f"{p[n]:.6f}")] + [""])
            bad_count += len(bad)
            bar.update(len(chunk))
    _write_csv(Path(out), header, rows)
    print(f"ddpflow: {len(files) - bad_count} image(s) predicted"
          + (f", {bad_count} unreadable (reason in the error column)" if bad_count else "")
          + f" with {Path(bundle)} on {dev.type} -> {out}")
    return 0


def _write_csv(path: Path, header: list, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    os.replace(tmp, path)
