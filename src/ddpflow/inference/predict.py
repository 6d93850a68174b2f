"""`ddpflow predict`: an export bundle on image files, no training config needed.

Images of any size and mode are read exactly like validation (inference.py), run through
the bundle's TorchScript model (or ONNX with onnxruntime), batched, on the GPU when there
is one, and written as a CSV: path (as given; files found in a folder are the folder
joined with their relative path), class (top-1 name), prob, then class_2, prob_2, ... up
to --top-k, and error (why an unreadable image has no prediction). The last line names
what ran the model: TorchScript on a device, or the onnxruntime provider the session took.
--device cuda with an onnxruntime that cannot take the GPU (no CUDAExecutionProvider, or
one that failed to load) is refused in one line; auto then runs on the CPU provider and
says so.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from ddpflow.core import reading, writing
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import write_csv
from ddpflow.data.crops import EvalCrop
from ddpflow.inference.common import decode, image_files, preprocess
from ddpflow.inference.export import CLASSIFIER_SCHEMA, MANIFEST_SCHEMA

BATCH = 64  # images per forward
DEFAULT_TOP_K = 5  # --top-k not given: 5 classes per image, or all when fewer


def load_bundle(folder: str | Path) -> dict:
    """model.json of an export bundle, validated before any field is used (reading.py), the
    files it lists kept inside the bundle and checked against their SHA-256."""
    folder = Path(folder)
    manifest = folder / "model.json"
    what, fix = "export bundle manifest", "make a bundle with `ddpflow export --config ...`"
    if folder.is_file():
        raise UserError(f"--bundle {folder} is a file; give the folder `ddpflow export` "
                        f"wrote (it holds model.json)")
    spec = reading.read_json(manifest, MANIFEST_SCHEMA, what, fix)
    if spec["task"] != "classification":
        task = " ".join(spec["task"].split())[:40]
        raise UserError(f"{folder} holds a {task} model; predict writes classes and "
                        f"probabilities, which only a classification model gives "
                        f"(load model.ts or model.onnx yourself for its raw outputs)")
    reading.validate(spec, CLASSIFIER_SCHEMA, manifest, what, f"{reading.NOT_OURS}; {fix}")
    channels = 1 if spec["grayscale"] else 3
    for key, want, meaning in (("classes", spec["num_classes"], "num_classes"),
                               ("mean", channels, "the image channels"),
                               ("std", channels, "the image channels")):
        if len(spec[key]) != want:
            raise UserError(f"{manifest} ({what}): {key}: {len(spec[key])} item(s), but "
                            f"{meaning} says {want}; {reading.NOT_OURS}; {fix}")
    for fmt, f in spec["files"].items():
        path = reading.inside(folder, f["file"], f"{manifest}: files.{fmt}.file", fix)
        if not path.is_file():
            raise UserError(f"the bundle {folder} lacks {f['file']} ({fmt}) that model.json "
                            f"lists; export again")
        if sha256_of(path) != f["sha256"]:
            raise UserError(f"{path} does not match its SHA-256 in model.json (changed or "
                            f"damaged since export); export again")
    return spec


def _runner(spec: dict, folder: Path, fmt: str, device: torch.device, explicit: bool):
    """((inputs float NCHW) -> logits, the device the inputs go to, what runs the model: a
    device, or onnxruntime's provider that the session actually took). `explicit`: the
    user asked for this device (--device cuda), so the ONNX file is refused rather than
    run on the CPU when onnxruntime cannot take the GPU."""
    files = spec["files"]
    if fmt == "auto":
        fmt = "torchscript" if "torchscript" in files else "onnx"
    if fmt not in files:
        raise UserError(f"the bundle has no {fmt} model (it has: {', '.join(files)})")
    path = str(reading.inside(folder, files[fmt]["file"], f"{folder}/model.json: files.{fmt}.file"))
    if fmt == "torchscript":
        with warnings.catch_warnings():  # "deprecated in favour of torch.export": still works
            warnings.simplefilter("ignore", FutureWarning)
            model = torch.jit.load(path, map_location=device).eval()
        return (lambda x: model(x)), device, f"torchscript on {device.type}"
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("--format onnx needs onnxruntime: pip install onnxruntime") from None
    cuda = device.type == "cuda"
    providers = (["CUDAExecutionProvider"] if cuda else []) + ["CPUExecutionProvider"]
    session = ort.InferenceSession(path, providers=providers)
    used = session.get_providers()[0]  # the one that runs it (a CUDA one may fail to load)
    if cuda and used != "CUDAExecutionProvider":
        if explicit:
            raise UserError(
                f"--device cuda --format onnx: this onnxruntime runs on {used} only (it has "
                f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu for "
                f"the GPU, or use --format torchscript or --device cpu")
        print(f"ddpflow: note: onnxruntime has no usable CUDAExecutionProvider; the ONNX "
              f"model runs on {used}", file=sys.stderr)
    on = device if used == "CUDAExecutionProvider" else torch.device("cpu")
    return (lambda x: torch.from_numpy(session.run(None, {"input": x.cpu().numpy()})[0])), \
        on, f"onnx on {used}"


def predict(bundle: str, inputs: list[str], out: str, top_k: int | None = None, fmt: str = "auto",
            device: str = "auto") -> int:
    folder = Path(bundle)
    _check_args(top_k, device, Path(out))
    writing.claim_file(Path(out), WHAT, is_predictions)  # before the work, and again at the end
    spec = load_bundle(folder)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    run, dev, engine = _runner(spec, folder, fmt, dev, device == "cuda")
    files = image_files(inputs)
    k = min(top_k or DEFAULT_TOP_K, spec["num_classes"])
    if top_k is not None and k < top_k:  # asked for more than there are: said once
        print(f"ddpflow: note: --top-k {top_k} is more than the model's "
              f"{spec['num_classes']} classes; writing {k} per image", file=sys.stderr)
    ec = spec.get("eval_crop") or {"crop": spec["image_size"]}  # older bundles: the default
    pre = preprocess(spec["mean"], spec["std"], spec["image_size"], spec["input"]["channels"],
                     dev, EvalCrop(ec["crop"], ec.get("resize"), ec.get("interpolation",
                                                                      "bilinear")))
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
          + f" with {Path(bundle)} ({engine}) -> {out}")
    return 0


WHAT = "the predictions CSV"


def _check_args(top_k: int | None, device: str, out: Path) -> None:
    """The arguments, before the bundle is read or any image decoded: --top-k, --device,
    and --out's place (a missing parent folder is made when the CSV is written)."""
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: give the number of classes per image to write, "
                        f"1 or more")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to PyTorch here; use --device "
                        "cpu (or auto, which takes a GPU when there is one)")
    parent = next((a for a in out.absolute().parents if a.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"--out {out}: {parent} is a file, not a folder; give a CSV path in "
                        f"a folder")


def is_predictions(path: Path) -> bool:
    """A CSV `ddpflow predict` wrote (its header), which a new one may replace."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith("path,class,prob")
    except OSError:
        return False


def _write_csv(path: Path, header: list, rows: list) -> None:
    with writing.writing(path, WHAT):
        path.parent.mkdir(parents=True, exist_ok=True)
        writing.claim_file(path, WHAT, is_predictions)
        write_csv(path, header, rows)  # whole or not at all; no cell a spreadsheet would run
