"""Properties the docs claim, each asserted itself (not only a count or an argmax), at the
level of the function that decides: each of these once had a bug that a count missed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError


def test_export_check_compares_logit_values_not_only_the_top_class(tmp_path, monkeypatch):
    from ddpflow.inference import export

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)).eval()
    x = torch.randn(8, 3, 2, 2)
    with torch.no_grad():
        ref = model(x)
    # scaled logits keep every argmax: only a comparison of the values can catch them
    monkeypatch.setitem(export.WRITERS, "torchscript", lambda m, x, path: ref * 1.5)
    c = export._write_format("torchscript", model, x, ref, tmp_path / "model.ts")
    assert c["same_top1"] and not c["ok"], c
    assert c["max_abs_diff"] == pytest.approx((ref * 0.5).abs().max().item())
    assert "differ" in c["error"]
    # within the tolerance, relative to the logits' scale: passes
    big = ref * 1e4
    monkeypatch.setitem(export.WRITERS, "torchscript", lambda m, x, path: big + 0.5)
    c = export._write_format("torchscript", model, x, big, tmp_path / "model.ts")
    assert c["ok"] and c["tolerance"] == pytest.approx(export.RTOL * big.abs().max().item())


def test_export_check_fails_on_a_changed_top_class_passes_at_the_tolerance_and_reports_errors(
        tmp_path, monkeypatch):
    import errno

    from ddpflow.inference import export

    x = torch.zeros(2, 3, 1, 1)
    path = tmp_path / "model.ts"
    net = torch.nn.Identity()  # the writers are replaced: what they are handed only

    def writer(out):
        return lambda m, x, path: out

    # a change far inside the tolerance that moves row 0's top class: not the same model
    ref = torch.tensor([[0.0, 1e-6], [5.0, 0.0]])
    monkeypatch.setitem(export.WRITERS, "torchscript", writer(torch.tensor([[1e-6, 0.0],
                                                                            [5.0, 0.0]])))
    c = export._write_format("torchscript", net, x, ref, path)
    assert c["checked"] is True and not c["same_top1"] and c["ok"] is False, c
    # a difference of exactly the tolerance passes (<=)
    monkeypatch.setattr(export, "RTOL", 0.5)
    ref = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    monkeypatch.setitem(export.WRITERS, "torchscript", writer(ref + torch.tensor([[0.5, 0.0],
                                                                                  [0.0, 0.0]])))
    c = export._write_format("torchscript", net, x, ref, path)
    assert c["ok"] is True and c["max_abs_diff"] == c["tolerance"] == 0.5 and c["error"] is None
    # written but nothing here runs it (onnx without onnxruntime): ok, marked not checked
    monkeypatch.setitem(export.WRITERS, "onnx", lambda m, x, path: None)
    assert export._write_format("onnx", net, x, ref, path)["checked"] is False
    assert export._write_format("onnx", net, x, ref, path)["ok"] is True

    def fails(m, x, path, err=None, write=True):
        if write:
            path.write_bytes(b"half")
        raise err or ValueError("no tracer for this\nsecond line")

    # the exporter fails: reported for that format, its half-written file removed
    monkeypatch.setitem(export.WRITERS, "torchscript", fails)
    assert export._write_format("torchscript", net, x, ref, path) == {
        "ok": False, "error": "ValueError: no tracer for this", "checked_on": ["cpu"]}
    assert not path.exists()
    monkeypatch.setitem(export.WRITERS, "torchscript", lambda m, x, path: fails(
        m, x, path, write=False))
    assert export._write_format("torchscript", net, x, ref, path)["ok"] is False  # no file
    # a full disk is not the format's fault: raised, for build_folder to name the target
    monkeypatch.setitem(export.WRITERS, "torchscript", lambda m, x, path: fails(
        m, x, path, OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        export._write_format("torchscript", net, x, ref, path)


def test_evaluate_counts_each_image_exactly_once_on_any_number_of_ranks(tmp_path):
    from ddpflow.inference import evaluate

    for n in (0, 1, 9, 10, 13):
        for world in (1, 2, 3, 4, 8):
            parts = [evaluate.share(n, r, world) for r in range(world)]
            together = np.concatenate(parts)
            assert sorted(together.tolist()) == list(range(n)), (n, world, parts)
            evaluate.each_once(together, n, 0)
    with pytest.raises(RuntimeError, match="counted twice"):
        evaluate.each_once(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 0]), 9, 0)
    # the ranks' tallies summed (as evaluate.combine does): 9 images on 2 ranks, each once
    from ddpflow.inference.common import Tally

    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    total = Tally(3, torch.device("cpu"))
    for r in range(2):
        idx = evaluate.share(9, r, 2)
        logits = torch.nn.functional.one_hot(torch.as_tensor(labels[idx]), 3).float()
        logits[idx == 4] = torch.tensor([0.0, 0.0, 1.0])  # image 4 (a 1) taken for a 2
        mine = Tally(3, torch.device("cpu"))
        mine.add(logits, torch.as_tensor(labels[idx]))
        total.confusion += mine.confusion
        total.sums += mine.sums
    cfg = SimpleNamespace(data=SimpleNamespace(image_size=16, store_size=18), hash="h")
    meta = {"num_classes": 3, "classes": ["a", "b", "c"]}
    evaluate._write(cfg, meta, total.scores(), [], tmp_path,
                    {"stage": "s", "split": "val", "weights": {}, "world_size": 2})
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert np.array(m["confusion"]).tolist() == [[3, 0, 0], [0, 2, 1], [0, 0, 3]]
    assert m["acc"] == pytest.approx(8 / 9)


def test_leaderboard_best_is_the_lowest_value_when_the_monitor_is_minimised():
    from ddpflow.sweeps.leaderboard import rank

    def rows(mode):
        return [{"trial": t, "status": "finished", "mode": mode, "best_value": v}
                for t, v in (("a", 0.9), ("b", 0.2), ("c", 0.5))]

    lo = rank(rows("min"))
    assert [r["trial"] for r in lo] == ["b", "c", "a"] and lo[0]["best"]
    assert [r["best"] for r in lo] == [True, False, False]
    hi = rank(rows("max"))
    assert [r["trial"] for r in hi] == ["a", "c", "b"] and hi[0]["best"]


def test_leaderboard_ranks_unfinished_and_valueless_trials_last_and_numbers_every_row():
    from ddpflow.sweeps.leaderboard import rank

    rows = [{"trial": "a", "status": "failed", "mode": "min", "best_value": 0.1},
            {"trial": "b", "status": "finished", "mode": "min", "best_value": None},
            {"trial": "c", "status": "finished", "mode": "min", "best_value": float("nan")},
            {"trial": "d", "status": "finished", "mode": "min", "best_value": 0.0},
            {"trial": "e", "status": "finished", "mode": "min", "best_value": 0.5}]
    ranked = rank(rows)
    assert [(r["trial"], r["rank"], r["best"]) for r in ranked] == [
        ("d", 1, True), ("e", 2, False), ("a", 3, False), ("b", 4, False), ("c", 5, False)]
    # no trial finished with a value: none is the best
    ranked = rank([r for r in rows if r["trial"] in "abc"])
    assert [(r["trial"], r["best"]) for r in ranked] == [("a", False), ("b", False),
                                                          ("c", False)]


def _batches(rank: int, epoch: int, seed: int = 0, steps: int = 2):
    """Mixup/cutmix soft targets and the step generators' first draws of a tiny device
    loader (a label per image: a row of the targets shows the batch's lambda)."""
    from ddpflow.data.loaders import Normalize, TrainBatches, step_generator
    from ddpflow.data.mixing import Recipe

    n = 32
    images = np.random.default_rng(0).integers(0, 255, (n, 8, 8, 3), dtype=np.uint8)
    aug = from_dict({"stages": [{"name": "a"}]}).data.augment
    cpu = torch.device("cpu")
    tb = TrainBatches("device", images, np.arange(n), 4, cpu, 2, rank, seed, aug,
                      Normalize([0.5] * 3, [0.25] * 3, cpu, 3, False),
                      recipe=Recipe(mixup_alpha=0.4, cutmix_alpha=1.0, num_classes=n))
    out = []
    for step, (_, y) in zip(range(steps), tb.epoch(epoch)):
        lam = sorted(set(np.round(y[0].numpy(), 6).tolist()) - {0.0})
        g = step_generator(cpu, seed, epoch, step, rank)
        out.append((lam, torch.rand(3, generator=g).tolist()))
    return out


def test_mixup_and_cutmix_draws_differ_across_epochs_and_ranks_and_repeat_exactly():
    a = _batches(rank=0, epoch=0)
    assert a == _batches(rank=0, epoch=0)  # the same (seed, epoch, step, rank): the same
    for other in (_batches(rank=0, epoch=1), _batches(rank=1, epoch=0),
                  _batches(rank=0, epoch=0, seed=1)):
        for (lam_a, g_a), (lam_o, g_o) in zip(a, other):
            assert lam_a != lam_o and g_a != g_o, (a, other)


def test_seed_sequence_is_the_same_everywhere_63_bit_and_wraps_negative_keys():
    from ddpflow.core.seeds import seed_sequence

    # pinned: a checkpoint resumed on another machine draws the same streams
    assert [seed_sequence(0), seed_sequence(1, 2, 3)] == [6569863346532939966,
                                                          3773880422699760768]
    seeds = [seed_sequence(7, i) for i in range(64)]
    assert all(0 <= v < 2**63 for v in seeds) and max(seeds) >= 2**62  # all 63 bits used
    assert any(v % 2 for v in seeds) and len(set(seeds)) == 64
    # a negative key is taken modulo 2**64 (SeedSequence takes no negatives)
    assert seed_sequence(-1) == seed_sequence(2**64 - 1) != seed_sequence(2**63 - 1)


def test_prepare_fingerprint_changes_when_the_factory_code_changes(tmp_path):
    from ddpflow.data.prepare import fingerprint, settings_fingerprint

    code = tmp_path / "code"
    code.mkdir()
    src = code / "mydata.py"
    src.write_text("def make(split):\n    return [], 3\n")
    cfg = from_dict(tiny_config(tmp_path, data={"source": "python", "factory": "mydata:make",
                                                "code_dir": str(code)}))
    before = fingerprint(cfg), settings_fingerprint(cfg)
    stat = src.stat()
    src.write_text("def make(split):\n    return [], 4\n")  # the same size
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = fingerprint(cfg), settings_fingerprint(cfg)
    assert after[0] != before[0] and after[1] != before[1]


def _bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(bytes(range(256)) * 8)
    spec = {"format_version": 1, "task": "classification", "num_classes": 2,
            "classes": ["a", "b"], "input": {"channels": 3}, "image_size": 16,
            "store_size": 18, "grayscale": False, "mean": [0.5] * 3, "std": [0.25] * 3,
            "files": {"onnx": {"file": "model.onnx",
                               "sha256": sha256_of(folder / "model.onnx"),
                               "bytes": (folder / "model.onnx").stat().st_size}}}
    (folder / "model.json").write_text(json.dumps(spec))
    return folder


def test_predict_refuses_a_bundle_file_with_one_byte_flipped_in_place(tmp_path):
    from ddpflow.inference.predict import load_bundle

    folder = _bundle(tmp_path)
    assert load_bundle(folder)["files"]["onnx"]["file"] == "model.onnx"
    f = folder / "model.onnx"
    data = bytearray(f.read_bytes())
    data[100] ^= 0x01  # the same size
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match="does not match its SHA-256"):
        load_bundle(folder)


def _after_a_clock_tick(path: Path) -> None:
    """Until the file system's clock shows a later change time than `path`'s (it may tick
    coarsely): a rewrite after this cannot keep the same change time by chance."""
    probe = path.with_name(".tick")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            probe.unlink()
            return
    raise AssertionError("the file system's change time did not move in 10 s")


def test_an_image_replaced_with_its_size_and_time_kept_changes_the_data_fingerprint(tmp_path):
    from ddpflow.data.prepare import fingerprint
    from ddpflow.results.provenance import make_record
    from fixtures import image_tree

    root = image_tree(tmp_path / "imgs", per_class=2)
    cfg = from_dict(tiny_config(tmp_path, data={"source": "imagefolder", "path": str(root)}))
    before = fingerprint(cfg)
    img = next(root.rglob("*.png"))
    stat = img.stat()
    _after_a_clock_tick(img)
    data = bytearray(img.read_bytes())
    data[-20] ^= 0xFF
    img.write_bytes(bytes(data))
    os.utime(img, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (img.stat().st_size, img.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    after = fingerprint(cfg)
    assert after != before  # prepared again, and a checkpoint of the old data not resumed
    assert make_record(cfg, "s1", after, None) != make_record(cfg, "s1", before, None)


def test_a_stage_result_is_fresh_only_with_its_own_record_and_its_own_final_pt(tmp_path,
                                                                              monkeypatch):
    from ddpflow.results import provenance

    cfg = from_dict(tiny_config(tmp_path, stages=[{"name": "a"},
                                                  {"name": "b", "init_from": "previous"}]))
    cfg.data_dir.mkdir(parents=True)
    (cfg.data_dir / "meta.json").write_text("{not json")  # damaged: no fingerprint, no error
    a_final = cfg.stage_dir("a") / "final.pt"
    assert provenance.expected_record(cfg, "b")["init_sha256"] is None  # a not finished
    a_final.parent.mkdir(parents=True)
    a_final.write_bytes(b"weights of a")
    want = provenance.expected_record(cfg, "b")
    assert want == {"stage_hash": cfg.stage_hash("b"), "code": want["code"],
                    "user_code": want["user_code"], "data": None,
                    "init_sha256": sha256_of(a_final)}
    folder = cfg.stage_dir("b")
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{trunc")  # damaged summary: not a result, no error
    assert provenance.stage_result(cfg, "b") == (None, None)
    final = folder / "final.pt"
    s = {"finished": True, "record": dict(want), "final_sha256": sha256_of(a_final)}
    monkeypatch.setattr(provenance, "read_summary", lambda path, damaged_ok=False: s)
    assert provenance.stage_result(cfg, "b") == (s, "stale: final.pt is missing")
    final.write_bytes(b"weights of a")  # the recorded final.pt
    assert provenance.stage_result(cfg, "b") == (s, None)
    final.write_bytes(b"weights of c")
    assert provenance.stage_result(cfg, "b")[1] == (
        "stale: final.pt was replaced after the stage finished")
    final.write_bytes(b"weights of a")
    for key, why in provenance.REASONS.items():
        s["record"] = {**want, key: "other"}
        assert provenance.stage_result(cfg, "b") == (s, f"stale: {why}"), key
    s["record"] = None
    assert provenance.stage_result(cfg, "b")[1].startswith("stale: no record")
    monkeypatch.setattr(provenance, "read_summary", lambda path, damaged_ok=False: None)
    assert provenance.stage_result(cfg, "b") == (None, None)
