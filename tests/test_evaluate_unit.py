"""inference/evaluate.py, edge by edge: the figures `ddpflow evaluate` writes (metrics.json,
per_class.csv, confusion.png) are the stage model's own on every image of the split or the
labelled folder, each counted once however many ranks share them (a real 2-rank torchrun,
gloo); the folder it writes to, the line it prints, the empty split it refuses or records;
each refusal's words (no prepared data, another task, an unlabelled folder, split folders,
classes the model does not know); a folder of an older version it may replace, and what it
must not. Fast: the stages are written as a finished stage writes them (final.pt, best.pt
with their checksums, summary.json with its record), on real prepared data, without
training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import tiny_config, write_config
from ddpflow import cli
from ddpflow.config import load_config
from ddpflow.data import crops, prepared
from ddpflow.inference import common, evaluate
from ddpflow.results import plots
from fixtures import image_tree
from test_inference_unit import _finish, _refusal, _weights  # the same stages, written


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Prepared synthetic data (3 classes, 16 px; 11 test and 10 val images, so two ranks
    get shares of different sizes) and two finished stages: s1 without an EMA, s2 with one."""
    tmp = tmp_path_factory.mktemp("evu")
    raw = tiny_config(tmp, data={"train_size": 24, "val_size": 10, "test_size": 11,
                                 "num_classes": 3},
                      hardware={"nproc_per_node": 2, "threads_per_rank": 1},
                      stages=[{"name": "s1", "epochs": 1, "batch_size": 8, "lr": 0.05},
                              {"name": "s2", "epochs": 1, "batch_size": 8, "lr": 0.05,
                               "ema": {"decay": 0.9, "every_steps": 1}}])
    p = write_config(tmp, raw)
    assert cli.main(["prepare", "--config", str(p)]) == 0
    cfg = load_config(p)
    meta = prepared.read_meta(cfg.data_dir)
    w = {n: _weights(cfg, meta, n) for n in range(5)}
    _finish(cfg, "s1", w[0], w[1])
    _finish(cfg, "s2", w[2], w[3], ema=w[4])
    return tmp, p, cfg, meta


def _logits(cfg, meta, stage: str, weights: str, x: np.ndarray) -> torch.Tensor:
    model, _ = common.stage_model(cfg, meta, stage, weights)
    pre = common.preprocess(meta["mean"], meta["std"], cfg.data.image_size,
                            meta["image_shape"][2], "cpu", crops.eval_sizes(cfg.data))
    with torch.no_grad():
        return model(pre(torch.from_numpy(np.array(x))))


def _expected(cfg, meta, stage: str, weights: str, split: str) -> dict:
    """The scores of the stage's weights on the whole split, in one forward here."""
    _, arrays = prepared.load(cfg.data_dir)
    x, y = arrays[split]
    return common.scores(_logits(cfg, meta, stage, weights, x[:]),
                         torch.as_tensor(np.array(y), dtype=torch.long), meta["num_classes"])


def _same_scores(m: dict, want: dict) -> None:
    assert m["samples"] == want["samples"]
    assert m["confusion"] == want["confusion"]
    assert m["acc"] == pytest.approx(want["acc"]) and m["top5"] == pytest.approx(want["top5"])
    assert m["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert m["per_class"]["support"] == want["per_class"]["support"]
    for k in ("precision", "recall", "f1"):
        assert m["per_class"][k] == pytest.approx(want["per_class"][k]), k


def _per_class_csv(classes, pc) -> str:
    rows = ["class,precision,recall,f1,support"] + [
        f"{c},{pc['precision'][i]:.6f},{pc['recall'][i]:.6f},{pc['f1'][i]:.6f},"
        f"{pc['support'][i]}" for i, c in enumerate(classes)]
    return "\r\n".join(rows) + "\r\n"


def _png(path: Path, size=(20, 14), seed=0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB").save(path)
    return path


# ------------------------------------------------------------------ the figures

def test_two_ranks_score_every_test_image_once_as_the_model_does(made, capsys):
    """The default: the last stage's final weights (s2: its EMA's) on the test split, two
    ranks of a real torchrun; the result folder is results/<run>/evaluate/s2/test-final."""
    _, _, cfg, meta = made
    folder = cfg.run_dir / "evaluate" / "s2" / "test-final"
    assert evaluate.out_dir(cfg, "s2", "test", "final") == folder
    assert evaluate.out_dir(cfg, "s1", None, "best") == cfg.run_dir / "evaluate/s1/images-best"
    capsys.readouterr()
    assert evaluate.launch(cfg, None, "test", None, "final", None) == 0
    m = json.loads((folder / "metrics.json").read_text())
    want = _expected(cfg, meta, "s2", "final", "test")
    assert want["samples"] == 11
    _same_scores(m, want)
    _, record = common.stage_weights(cfg, "s2", "final")
    assert m["weights"] == record and record["holds"] == "ema"
    assert (m["stage"], m["split"], m["world_size"]) == ("s2", "test", 2)
    assert m["classes"] == meta["classes"] and m["skipped"] == []
    assert (m["image_size"], m["store_size"]) == (cfg.data.image_size, cfg.data.store_size)
    assert m["config_hash"] == cfg.hash and m["data_fingerprint"] == meta["fingerprint"]
    assert json.loads((folder / "config.json").read_text()) == cfg.to_dict()
    assert (folder / "per_class.csv").read_bytes().decode() == \
        _per_class_csv(meta["classes"], m["per_class"])
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        f"ddpflow: s2 final.pt (ema weights, fp32) on test: acc {m['acc']:.4f}, top5 "
        f"{m['top5']:.4f}, loss {m['loss']:.4f} over 11 images -> {folder}")
    # the confusion plot: the summed matrix, titled with the stage and the split
    ref = plots.confusion(np.array(want["confusion"]), meta["classes"],
                          folder.parent / "ref.png", "s2 on test")
    assert (folder / "confusion.png").read_bytes() == ref.read_bytes()


def test_one_rank_in_process_scores_a_split_with_the_chosen_weights(made, tmp_path):
    _, _, cfg, meta = made
    evaluate.rank_main(cfg, "s1", "val", None, "best", tmp_path)
    m = json.loads((tmp_path / "metrics.json").read_text())
    _same_scores(m, _expected(cfg, meta, "s1", "best", "val"))
    _, record = common.stage_weights(cfg, "s1", "best")
    assert m["weights"] == record and m["world_size"] == 1 and m["split"] == "val"
    assert m["samples"] == 10


def test_a_labelled_folder_is_scored_with_its_unreadable_files_named(made, tmp_path):
    _, _, cfg, meta = made
    classes = meta["classes"]
    root = tmp_path / "photos"
    files = {c: [_png(root / c / f"p{i}.png", seed=10 * k + i) for i in range(2)]
             for k, c in enumerate(classes[:2])}
    broken = root / classes[1] / "b.png"
    broken.write_bytes(b"not a png")
    out = tmp_path / "out"
    out.mkdir()
    evaluate.rank_main(cfg, "s1", "test", str(root), "final", out)
    m = json.loads((out / "metrics.json").read_text())
    good = files[classes[0]] + files[classes[1]]
    x, kept, _ = common.decode([str(f) for f in good], cfg.data.store_size, False)
    assert kept == [0, 1, 2, 3]
    labels = torch.tensor([0, 0, 1, 1])
    want = common.scores(_logits(cfg, meta, "s1", "final", x), labels, 3)
    _same_scores(m, want)
    assert m["split"] == str(root) and m["samples"] == 4
    why = common.decode([str(broken)], cfg.data.store_size, False)[2][0]
    assert m["skipped"] == [{"file": str(broken), "reason": why}]
    ref = plots.confusion(np.array(want["confusion"]), classes, tmp_path / "ref.png",
                          "s1 on photos")
    assert (out / "confusion.png").read_bytes() == ref.read_bytes()


def test_a_rank_scores_its_rows_batch_by_batch_as_all_at_once(made):
    _, _, cfg, meta = made
    _, arrays = prepared.load(cfg.data_dir)
    x, y = arrays["val"]
    x, y = np.array(x[:]), np.array(y)
    model, _ = common.stage_model(cfg, meta, "s1", "final")
    pre = common.preprocess(meta["mean"], meta["std"], cfg.data.image_size, 3, "cpu")
    seen = []

    def rows(a, b):
        seen.append((a, b))
        return x[a:b]

    tally = evaluate.run_share(model, pre, rows, y, 3, torch.device("cpu"), batch=4)
    assert sorted(seen) == [(0, 4), (4, 8), (8, 12)]
    _same_scores(tally.scores(), _expected(cfg, meta, "s1", "final", "val"))


def test_each_image_once_or_the_count_is_refused():
    evaluate.each_once(np.array([2, 0, 1], dtype=np.int64), 3, 0)
    evaluate.each_once(np.array([2, 0], dtype=np.int64), 3, 1)  # one skipped
    evaluate.each_once(np.array([], dtype=np.int64), 2, 2)
    for idx, n, skipped in [([0, 1, 1], 3, 0), ([0, 1], 3, 0), ([0, 1, 2], 3, 1),
                            ([-1, 0, 1], 3, 0), ([1, 2, 3], 3, 0)]:
        with pytest.raises(RuntimeError) as e:
            evaluate.each_once(np.array(idx, dtype=np.int64), n, skipped)
        assert str(e.value) == (
            f"evaluate gathered {len(idx)} results ({len(set(idx))} distinct) for {n} images "
            f"({skipped} skipped): an image was counted twice or not at all")


def test_shares_are_strided_by_rank():
    assert evaluate.share(7, 1, 3).tolist() == [1, 4]
    assert evaluate.share(7, 0, 1).tolist() == list(range(7))
    assert evaluate.share(7, 0, 2).dtype == np.int64


# ------------------------------------------------------------------ a rank that fails

NET = """
import os

from torch import nn


class Net(nn.Module):
    # a user's model that fails once it is evaluated (more than the 2 images of the
    # contract's probe, in eval mode)
    def __init__(self, num_classes, in_channels=3, on_eval="exit"):
        super().__init__()
        self.head = nn.Linear(in_channels, num_classes)
        self.on_eval = on_eval

    def forward(self, x):
        if not self.training and x.shape[0] > 2:
            if self.on_eval == "exit":
                os._exit(0)  # gone without a word, and without a result
            raise RuntimeError("the model broke")
        return self.head(x.mean((2, 3)))


def build(num_classes, in_channels=3, on_eval="exit"):
    return Net(num_classes, in_channels, on_eval)
"""


@pytest.fixture(scope="module")
def broken(made, tmp_path_factory):
    """s1 of the user's model above (test_evaluate_unit_net.py), finished, on made's data;
    s2 finished with weights that do not fit it."""
    _, p, cfg, meta = made
    code = tmp_path_factory.mktemp("evu-net")
    (code / "test_evaluate_unit_net.py").write_text(NET)
    over = [f"results_dir={code / 'results'}", f"data.prepared_dir={cfg.data_dir}",
            "model.name=test_evaluate_unit_net:build", f"model.code_dir={code}",
            "hardware.nproc_per_node=1", "hardware.max_restarts=0"]
    net = load_config(p, over)
    _finish(net, "s1", _weights(net, meta, 0), _weights(net, meta, 1))
    other = _weights(cfg, meta, 2)  # s2: the weights of another model (smallcnn)
    _finish(net, "s2", other, other, ema=other)
    return net, p, over


def _earlier_result(folder: Path, cfg) -> None:
    """An earlier evaluation's files in the folder, and a several-node run's roll call."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    (folder / "metrics.json").write_text('{"acc": 0.99}')
    (folder / "nodes").mkdir()
    (folder / "nodes" / "node-a").write_text("here")


def test_a_mistake_a_rank_finds_is_one_message_and_no_result(broken, tmp_path):
    """Weights that do not fit the model are found by the ranks (the launcher reads the
    file only): their message is the command's."""
    net, _, _ = broken
    folder = tmp_path / "ev"
    final = net.stage_dir("s2") / "final.pt"
    text = _refusal(evaluate.launch, net, "s2", "test", None, "final", str(folder))
    assert text.startswith(f"{final} (final) does not fit the model: "), text
    assert not (folder / "metrics.json").exists()


def test_a_rank_that_ends_without_a_result_is_a_failure_not_an_old_result(broken, tmp_path,
                                                                          capsys):
    net, _, _ = broken
    folder = tmp_path / "ev"
    _earlier_result(folder, net)
    capsys.readouterr()
    assert evaluate.launch(net, "s1", "test", None, "final", str(folder)) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ddpflow: error: evaluation failed (torchrun exited with 0)")
    assert not (folder / "metrics.json").exists() and not (folder / "nodes").exists()
    assert json.loads((folder / "config.json").read_text()) == net.to_dict()


def test_a_rank_that_crashes_is_torchruns_exit_status(broken, tmp_path, capsys):
    _, p, over = broken
    net = load_config(p, [*over, "model.kwargs.on_eval=raise"])
    folder = tmp_path / "ev"
    _earlier_result(folder, net)
    capsys.readouterr()
    rc = evaluate.launch(net, "s1", "test", None, "final", str(folder))
    assert rc == 1, rc
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ddpflow: error: evaluation failed (torchrun exited with 1)")
    assert not (folder / "metrics.json").exists()


# ------------------------------------------------------------------ refusals and empty splits

@pytest.fixture(scope="module")
def no_test(tmp_path_factory):
    """A finished 1-rank stage on a 3-class folder of 8 px images without a test split
    (data.test_fraction 0)."""
    tmp = tmp_path_factory.mktemp("evu-nt")
    image_tree(tmp / "imgs", per_class=4, size=(12, 10))
    raw = tiny_config(tmp, hardware={"nproc_per_node": 1, "threads_per_rank": 1},
                      stages=[{"name": "s1", "epochs": 1, "batch_size": 4, "lr": 0.05}])
    raw["data"] = {"source": "imagefolder", "path": str(tmp / "imgs"), "image_size": 8,
                   "train_size": None, "val_size": None, "val_fraction": 0.25,
                   "test_fraction": 0}
    p = write_config(tmp, raw)
    assert cli.main(["prepare", "--config", str(p)]) == 0
    cfg = load_config(p)
    meta = prepared.read_meta(cfg.data_dir)
    _finish(cfg, "s1", _weights(cfg, meta, 0), _weights(cfg, meta, 1))
    return tmp, p, cfg, meta


def test_an_empty_split_is_refused_or_recorded_with_allow_empty(no_test, capsys):
    _, _, cfg, _ = no_test
    assert _refusal(evaluate.launch, cfg, None, "test", None, "final", None) == (
        "--split test: the prepared data has no test split (data.test_fraction 0, or a "
        "data.factory without one); evaluate --split val, --images a labelled folder, or "
        "add --allow-empty to record an empty result")
    assert not (cfg.run_dir / "evaluate").exists()
    capsys.readouterr()
    assert evaluate.launch(cfg, "s1", "test", None, "best", None, allow_empty=True) == 0
    folder = cfg.run_dir / "evaluate/s1/test-best"
    assert json.loads((folder / "metrics.json").read_text()) == {
        "stage": "s1", "split": "test", "samples": 0, "note": "no test split"}
    cap = capsys.readouterr()
    assert cap.out == f"ddpflow: no test split to evaluate; wrote {folder / 'metrics.json'}\n"
    assert cap.err == ""
    assert not (folder / "config.json").exists()


def test_an_empty_result_goes_to_out_and_a_stale_stage_is_warned_of(no_test, tmp_path, capsys):
    _, p, _, _ = no_test
    stale = load_config(p, ["stages.0.lr=0.1"])
    capsys.readouterr()
    out = tmp_path / "mine"
    assert evaluate.launch(stale, "s1", "test", None, "final", str(out), allow_empty=True) == 0
    assert json.loads((out / "metrics.json").read_text())["note"] == "no test split"
    assert not (stale.run_dir / "evaluate/s1/test-final").exists()
    assert capsys.readouterr().err == (
        "ddpflow: warning: stage 's1' is stale: made with another config; its weights are "
        "used as they are (run the stage again for a fresh result)\n")


def test_an_older_versions_evaluation_is_replaced_a_foreign_folder_refused(no_test, tmp_path):
    _, _, cfg, _ = no_test
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(cfg.to_dict()))
    (old / "metrics.json").write_text('{"acc": 0.5}')
    assert evaluate.launch(cfg, "s1", "test", None, "final", str(old), allow_empty=True) == 0
    assert json.loads((old / "metrics.json").read_text())["samples"] == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"run": "x"}')
    (theirs / "metrics.json").write_text('{"acc": 0.5}')
    text = _refusal(evaluate.launch, cfg, "s1", "test", None, "final", str(theirs),
                    allow_empty=True)
    assert "already holds 'config.json', 'metrics.json', not written by ddpflow" in text, text
    assert (theirs / "metrics.json").read_text() == '{"acc": 0.5}'


def test_a_labelled_folder_beside_a_data_without_a_test_split_is_evaluated(no_test, capsys):
    """--images needs no split: one rank of a real torchrun; the folder is
    results/<run>/evaluate/<stage>/images-<weights>."""
    tmp, _, cfg, meta = no_test
    photos = image_tree(tmp / "photos", per_class=2, size=(15, 11), seed=1)
    capsys.readouterr()
    assert evaluate.launch(cfg, "s1", "test", str(photos), "final", None) == 0
    folder = cfg.run_dir / "evaluate/s1/images-final"
    m = json.loads((folder / "metrics.json").read_text())
    files, labels = evaluate._labelled_folder(str(photos), meta["classes"])
    x, kept, bad = common.decode(files, cfg.data.store_size, cfg.data.grayscale)
    assert not bad and len(kept) == 6
    want = common.scores(_logits(cfg, meta, "s1", "final", x),
                         torch.as_tensor(labels), meta["num_classes"])
    _same_scores(m, want)
    assert (m["split"], m["world_size"], m["skipped"]) == (str(photos), 1, [])
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"ddpflow: s1 final.pt (raw weights, fp32) on {photos}: acc {m['acc']:.4f}, top5 "
        f"{m['top5']:.4f}, loss {m['loss']:.4f} over 6 images -> {folder}")


def test_no_prepared_data_or_another_task_is_one_message(made, tmp_path):
    _, p, cfg, _ = made
    other = load_config(p, [f"results_dir={tmp_path / 'r'}"])
    assert _refusal(evaluate.launch, other, "s1", "test", None, "final", None) == (
        f"no prepared data at {other.data_dir}; run `ddpflow prepare` first")
    assert _refusal(evaluate._meta, other) == (
        f"no prepared data at {other.data_dir}; run `ddpflow prepare` first")
    changed = load_config(p, ["data.image_size=12"])
    assert "was made with other data settings" in _refusal(evaluate._meta, changed)
    regression = load_config(p, ["task.name=regression"])
    assert _refusal(evaluate.launch, regression, None, "test", None, "final", None) == (
        "ddpflow evaluate reports classification metrics; task.name is regression (its "
        "metrics are in the stage's summary.json)")
    assert evaluate._meta(cfg)["classes"] == ["class0", "class1", "class2"]
    assert _refusal(evaluate.launch, other, "nope", "test", None, "final", None) == (
        "no stage named 'nope' in the config; stages are: s1, s2")


def test_weights_that_cannot_be_used_are_refused_before_anything_is_written(made):
    _, _, cfg, _ = made
    assert _refusal(evaluate.launch, cfg, "s1", "test", None, "ema", None) == (
        "stage 's1' kept no EMA of its weights (stages[].ema.decay is null); use --weights "
        "final or best")
    assert not (cfg.run_dir / "evaluate" / "s1" / "test-ema").exists()


def test_a_folder_of_split_or_unknown_class_folders_is_refused_before_anything_is_written(
        made, tmp_path):
    _, _, cfg, meta = made
    classes = meta["classes"]
    for names, first in [(["Dev", "Testing", "train"], "Testing"), (["valid", "train"], "train")]:
        root = tmp_path / "-".join(names)
        for n in names:
            _png(root / n / classes[0] / "a.png")
        assert _refusal(evaluate.launch, cfg, "s1", "test", str(root), "final", None) == (
            f"--images {root} holds split folders ({', '.join(sorted(names))}), not class "
            f"folders: give one split's folder, e.g. --images {root / first}")
    root = tmp_path / "zoo"
    for n in ["a", "b", "c", "d", "e", "f", classes[0]]:
        _png(root / n / "x.png")
    assert _refusal(evaluate.launch, cfg, "s1", "test", str(root), "final", None) == (
        f"--images {root} has class folder(s) the model does not know: a, b, c, d, e; its "
        f"classes are class0, class1, class2: give a folder of those classes")
    many = [f"k{i:02d}" for i in range(25)]
    assert _refusal(evaluate._labelled_folder, str(root), many).endswith(
        f"its classes are {', '.join(many[:20])}: give a folder of those classes")
    fix = "give a labelled folder DIR/<class>/<image> (class names as in training)"
    assert _refusal(evaluate.launch, cfg, "s1", "test", str(tmp_path / "gone"), "final",
                    None) == f"--images: {tmp_path / 'gone'} does not exist; {fix}"
    a_file = root / "a" / "x.png"
    assert _refusal(evaluate.launch, cfg, "s1", "test", str(a_file), "final", None) == \
        f"--images: {a_file} is a file, not a folder; {fix}"
    assert not (cfg.run_dir / "evaluate" / "s1").exists()


def test_a_labelled_folder_gives_the_models_class_numbers(made, tmp_path):
    _, _, _, meta = made
    root = tmp_path / "f"
    a = _png(root / "class2" / "a.png")
    b = _png(root / "class0" / "b.png")
    c = _png(root / "class2" / "c.png")
    files, labels = evaluate._labelled_folder(str(root), meta["classes"])
    assert files == [str(b), str(a), str(c)]
    assert labels.tolist() == [0, 2, 2] and labels.dtype == np.int64


# ------------------------------------------------------------------ the folder it replaces

def test_an_evaluation_folder_of_an_older_version_is_recognised(made, tmp_path):
    _, _, cfg, _ = made
    old = tmp_path / "old"
    old.mkdir()
    assert not evaluate._is_evaluation(old)
    (old / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert not evaluate._is_evaluation(old)  # a config alone: no result
    (old / "per_class.csv").write_text("class,precision\n")
    assert evaluate._is_evaluation(old)
    (old / "per_class.csv").unlink()
    (old / "metrics.json").write_text("{}")
    assert evaluate._is_evaluation(old)
    (old / "stages").mkdir()  # a run folder: not an evaluation
    assert not evaluate._is_evaluation(old)
    (old / "stages").rmdir()
    (old / "config.json").write_text(json.dumps({"run": "t", "stages": []}))
    assert not evaluate._is_evaluation(old)  # not a resolved config
    (old / "config.json").write_text(json.dumps(cfg.to_dict()))
    (old / "metrics.json").unlink()
    (old / "metrics.json").mkdir()  # a folder named so holds no result
    assert not evaluate._is_evaluation(old)
