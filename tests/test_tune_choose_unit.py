"""engine/tune.py's phases 1b-3 in this process on a CPU: which batch sizes are measured up to
the agreed maximum, the loader settings and precisions tried after it, the choice of the
fastest of each (and what is chosen where tune.budget_s left a phase unmeasured), the rows
and lines they leave (choose, _precisions, _measured).

A candidate's throughput is a table the test writes (`Scripted.rate`) and its memory one too
(`Scripted.need`): real timings are noise, and the rules that pick from them are the point
(tests/test_tune_unit.py and tests/test_tune.py measure for real). A GPU's own answers
(whether it has native bf16, its core count) are injected where a CPU cannot give them. Fast:
no training step is run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import test_tune_unit
from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.engine import distributed, throughput, tune

CPU = torch.device("cpu")
MiB = 2**20
clock = test_tune_unit.clock  # the fixture: the monotonic clock the test moves


class Scripted:
    """A Probe's measurements from tables: `rate(candidate)` samples/s, `need(precision,
    channels_last)` bytes (None: does not fit); every candidate measured is kept in `calls`,
    and each takes `step_s` seconds on the test's clock."""

    def __init__(self, probe, clock, rate=lambda c: 100.0, need=lambda prec, cl: MiB,
                 step_s=0.0):
        self.probe, self.clock, self.rate, self.need, self.step_s = probe, clock, rate, need, \
            step_s
        self.calls: list[tuple] = []
        probe.measure = self.measure
        probe.step_bytes = self.step_bytes

    def measure(self, *candidate):
        self.calls.append(candidate)
        self.clock.now += self.step_s
        return {"samples_per_s": self.rate(candidate), "data_wait_fraction": 0.25}

    def step_bytes(self, b, precision, channels_last):
        return self.need(precision, channels_last)


def make_probe(tmp_path, budget_s=600.0, world=1, device=CPU, stage=None, **top):
    """A one-rank Probe (`world` ranks' share of this node where the test says so) of a
    ddp stage, its Pace's lines in `pace.lines`."""
    top.setdefault("data", {"num_workers": 3, "prefetch_factor": 5})
    cfg = from_dict(tiny_config(tmp_path, **top))
    d = distributed.Dist(0, 0, world, device, None)
    pace = tune.Pace(d, budget_s, False)
    pace.lines = []
    pace.say = pace.lines.append
    meta = {"num_classes": 4, "mean": [0.5] * 3, "std": [0.25] * 3, "image_shape": [16, 16, 3]}
    st = cfg.stage("s1") if stage is None else stage(cfg.stage("s1"))
    return tune.Probe(cfg, st, d, meta, None, None, 3, torch.nn.Linear(1, 1), 10**12, 0, pace)


@pytest.fixture
def cores(monkeypatch):
    """The cores this process may run on, as the test sets them (os.sched_getaffinity of
    pid 0: this process; another process's set is not this rank's)."""
    def set_to(n):
        monkeypatch.setattr(tune.os, "sched_getaffinity", lambda pid: {0: set(range(n))}[pid])
    set_to(16)
    return set_to


# ------------------------------------------------------------------ one measurement

def test_a_measurement_is_returned_with_its_line_and_the_device_released(tmp_path, clock,
                                                                        monkeypatch):
    released = []
    monkeypatch.setattr(throughput, "release", released.append)
    p = make_probe(tmp_path)
    s = Scripted(p, clock, rate=lambda c: 123.4)
    row = tune._measured(p, "batch 8", 8, "dataloader", 0, 2, "fp32", False, False)
    assert row == {"samples_per_s": 123.4, "data_wait_fraction": 0.25}
    assert s.calls == [(8, "dataloader", 0, 2, "fp32", False, False)]
    assert p.pace.lines == ["batch 8: 123 samples/s, data wait 25%"]
    assert released == [CPU]


def test_a_failed_measurement_still_releases_the_device(tmp_path, clock, monkeypatch):
    """An error in a candidate (an OOM under DDP) leaves the next one the same free memory."""
    released = []
    monkeypatch.setattr(throughput, "release", released.append)
    p = make_probe(tmp_path)

    def boom(*candidate):
        raise RuntimeError("CUDA out of memory")

    p.measure = boom
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        tune._measured(p, "batch 8", 8, "dataloader", 0, 2, "fp32", False, False)
    assert released == [CPU] and p.pace.lines == []


def test_no_measurement_once_the_budget_is_spent(tmp_path, clock):
    p = make_probe(tmp_path, budget_s=0.0)
    s = Scripted(p, clock)
    assert tune._measured(p, "batch 8", 8, "dataloader", 0, 2, "fp32", False, False) is None
    assert s.calls == [] and p.pace.skipped == ["batch 8"]
    assert p.pace.lines == ["batch 8: skipped (tune.budget_s 0 s spent)"]


# ------------------------------------------------------------------ the precision phase

LOADER = {"loader": "dataloader", "num_workers": 2, "prefetch_factor": 4}


def test_every_precision_and_layout_is_measured_at_the_chosen_batch(tmp_path, clock):
    p = make_probe(tmp_path)
    s = Scripted(p, clock, rate=lambda c: {"fp32": 100.0, "bf16": 200.0, "fp16": 300.0}[c[4]]
                 + c[5], need=lambda prec, cl: {"fp32": 4, "bf16": 2, "fp16": 2}[prec] * MiB + cl)
    rows = tune._precisions(p, 16, LOADER)
    expected = [{"precision": prec, "channels_last": cl, "compile": False, "fits": True,
                 "memory_bytes": {"fp32": 4, "bf16": 2, "fp16": 2}[prec] * MiB + cl,
                 "samples_per_s": {"fp32": 100.0, "bf16": 200.0, "fp16": 300.0}[prec] + cl,
                 "data_wait_fraction": 0.25}
                for prec in ("fp32", "bf16", "fp16") for cl in (False, True)]
    assert rows == expected
    assert s.calls == [(16, "dataloader", 2, 4, prec, cl, False)
                       for prec in ("fp32", "bf16", "fp16") for cl in (False, True)]
    assert p.pace.lines[:2] == ["batch 16, fp32, channels_last False, compile False: 100 "
                                "samples/s, data wait 25%",
                                "batch 16, fp32, channels_last True, compile False: 101 "
                                "samples/s, data wait 25%"]


def test_a_precision_that_does_not_fit_is_recorded_and_never_run(tmp_path, clock):
    p = make_probe(tmp_path)
    s = Scripted(p, clock, need=lambda prec, cl: None if prec == "fp32" else MiB)
    rows = tune._precisions(p, 16, LOADER)
    assert rows[:2] == [{"precision": "fp32", "channels_last": cl, "compile": False,
                         "fits": False, "memory_bytes": None} for cl in (False, True)]
    assert [r["fits"] for r in rows[2:]] == [True] * 4
    assert [c[4] for c in s.calls] == ["bf16", "bf16", "fp16", "fp16"]


def test_fsdp_measures_neither_fp16_nor_channels_last(tmp_path, clock):
    p = make_probe(tmp_path, stage=lambda st: dataclasses.replace(st, strategy="fsdp"))
    s = Scripted(p, clock)
    rows = tune._precisions(p, 8, LOADER)
    assert [(r["precision"], r["channels_last"], r["compile"]) for r in rows] == [
        ("fp32", False, False), ("bf16", False, False)]
    assert [(c[4], c[5]) for c in s.calls] == [("fp32", False), ("bf16", False)]


def test_tune_compile_measures_each_candidate_with_and_without_torch_compile(tmp_path, clock):
    p = make_probe(tmp_path, tune={"compile": True}, deterministic=False)
    s = Scripted(p, clock, rate=lambda c: 100.0 + 50 * c[6])
    rows = tune._precisions(p, 8, LOADER)
    assert [(r["precision"], r["channels_last"], r["compile"], r["samples_per_s"])
            for r in rows] == [(prec, cl, comp, 100.0 + 50 * comp)
                               for prec in ("fp32", "bf16", "fp16") for cl in (False, True)
                               for comp in (False, True)]
    assert len(s.calls) == 12 and s.calls[1] == (8, "dataloader", 2, 4, "fp32", False, True)


def test_a_candidate_past_the_budget_is_recorded_as_skipped(tmp_path, clock):
    p = make_probe(tmp_path, budget_s=0.0)
    s = Scripted(p, clock)
    rows = tune._precisions(p, 8, LOADER)
    assert rows[0] == {"precision": "fp32", "channels_last": False, "compile": False,
                       "fits": True, "memory_bytes": MiB, "skipped": "tune.budget_s spent"}
    assert all(r["skipped"] == "tune.budget_s spent" for r in rows) and len(rows) == 6
    assert s.calls == []
    assert p.pace.skipped[0] == "batch 8, fp32, channels_last False, compile False"


@pytest.mark.parametrize("native", [False, True])
def test_a_gpu_without_native_bf16_is_not_measured_in_bf16(tmp_path, clock, monkeypatch,
                                                          native):
    """A T4 or V100 only emulates bf16 (slowly): fp32 and fp16 only. Which GPU this is is
    injected: a CPU has no answer to give."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or including_emulation)
    p = make_probe(tmp_path, device=torch.device("cuda", 0))
    Scripted(p, clock)
    precs = [r["precision"] for r in tune._precisions(p, 8, LOADER)]
    assert precs == (["fp32"] * 2 + ["bf16"] * 2 + ["fp16"] * 2 if native
                     else ["fp32"] * 2 + ["fp16"] * 2)


# ------------------------------------------------------------------ the choice

@pytest.mark.parametrize("agreed, measured", [
    (1, [1]),
    (14, [1, 2, 4, 8, 14]),
    (16, [2, 4, 8, 16]),
    (20, [2, 4, 8, 16, 20]),
    (600_000, [2**17, 2**18, 2**19, 600_000]),
    (2**21 + 5, [2**18, 2**19, 2**20, 2**21, 2**21 + 5]),
])
def test_the_batches_measured_are_the_powers_of_two_from_an_eighth_of_the_maximum(
        tmp_path, clock, cores, agreed, measured):
    p = make_probe(tmp_path)
    s = Scripted(p, clock)
    choice, batch_rows, _, _ = tune.choose(p, agreed, "fp32", device_ok=True)
    assert [r["batch_size"] for r in batch_rows] == measured
    assert s.calls[:len(measured)] == [
        (b, "device", 3, 5, "fp32", False, False) for b in measured]
    assert p.pace.lines[0] == "batch %d: 100 samples/s, data wait 25%%" % measured[0]


def test_the_fastest_batch_loader_and_precision_are_chosen_one_after_the_other(
        tmp_path, clock, cores):
    p = make_probe(tmp_path, world=2)  # 16 cores shared by 2 ranks: 8 workers at most
    batch_rate = {2: 100.0, 4: 300.0, 8: 250.0, 16: 200.0}
    loader_rate = {("device", 0, 2): 500.0, ("dataloader", 0, 2): 400.0,
                   ("dataloader", 2, 2): 450.0, ("dataloader", 2, 4): 600.0,
                   ("dataloader", 8, 2): 550.0, ("dataloader", 8, 4): 350.0}
    prec_rate = {("fp32", False): 600.0, ("fp32", True): 610.0, ("bf16", False): 700.0,
                 ("bf16", True): 720.0, ("fp16", False): 780.0, ("fp16", True): 790.0}

    def rate(c):
        b, k, w, f, prec, cl, comp = c
        if len(s.calls) <= 4:
            return batch_rate[b]
        if len(s.calls) <= 10:
            return loader_rate[(k, w, f)]
        return prec_rate[(prec, cl)]

    s = Scripted(p, clock, rate=rate)
    choice, batch_rows, loader_rows, prec_rows = tune.choose(p, 16, "fp32", device_ok=True)
    # bf16 channels_last: fp16's 790 samples/s are not 10% over its 720
    assert choice == {"batch_size": 4, "loader": "dataloader", "num_workers": 2,
                      "prefetch_factor": 4, "precision": "bf16", "channels_last": True,
                      "compile": False}
    assert batch_rows == [{"batch_size": b, "samples_per_s": r, "data_wait_fraction": 0.25}
                          for b, r in batch_rate.items()]
    assert loader_rows == [{"loader": k, "num_workers": w, "prefetch_factor": f,
                            "samples_per_s": r, "data_wait_fraction": 0.25}
                           for (k, w, f), r in loader_rate.items()]
    assert [(r["precision"], r["channels_last"], r["samples_per_s"]) for r in prec_rows] == [
        (prec, cl, r) for (prec, cl), r in prec_rate.items()]
    assert s.calls[4:10] == [(4, k, w, f, "fp32", False, False) for k, w, f in loader_rate]
    assert s.calls[10:] == [(4, "dataloader", 2, 4, prec, cl, False) for prec, cl in prec_rate]
    assert p.pace.lines[4] == "batch 4, device loader, 0 workers, prefetch 2: 500 samples/s, " \
                              "data wait 25%"
    assert p.pace.lines[-1] == ("chose batch_size 4, loader dataloader, num_workers 2, "
                                "prefetch_factor 4, precision bf16, channels_last True, "
                                "compile False")


@pytest.mark.parametrize("n, world, workers", [(16, 1, [0, 2, 16]), (3, 2, [0, 1, 2]),
                                               (2, 2, [0, 1, 2]), (1, 2, [0, 1, 2])])
def test_the_loaders_tried_are_0_and_2_workers_and_a_ranks_share_of_the_cores(
        tmp_path, clock, cores, n, world, workers):
    """Without the device loader (it does not fit): DataLoaders only; a rank's share of the
    cores is at least 1."""
    cores(n)
    p = make_probe(tmp_path, world=world)
    Scripted(p, clock)
    choice, _, loader_rows, _ = tune.choose(p, 4, "fp32", device_ok=False)
    assert [(r["loader"], r["num_workers"], r["prefetch_factor"]) for r in loader_rows] == [
        ("dataloader", w, f) for w in workers for f in ((2, 4) if w else (2,))]
    assert all(type(r["num_workers"]) is int for r in loader_rows)
    # equal throughput everywhere: the first of each phase
    assert (choice["batch_size"], choice["loader"], choice["num_workers"]) == (
        1, "dataloader", 0)


def test_a_phase_the_budget_left_unmeasured_takes_the_stage_s_settings(tmp_path, clock,
                                                                      cores):
    """Four batches of 1 s each in a budget of 4 s: the loader and precision phases are
    skipped; the default loader (the config's DataLoader settings) and the stage's precision
    and layout are chosen, and the last line says how many candidates were skipped."""
    p = make_probe(tmp_path, budget_s=4.0)
    s = Scripted(p, clock, rate=lambda c: {2: 10.0, 4: 30.0, 8: 20.0, 16: 15.0}[c[0]],
                 step_s=1.0)
    choice, batch_rows, loader_rows, prec_rows = tune.choose(p, 16, "bf16", device_ok=False)
    assert choice == {"batch_size": 4, "loader": "dataloader", "num_workers": 3,
                      "prefetch_factor": 5, "precision": "bf16", "channels_last": False,
                      "compile": False}
    assert len(s.calls) == 4 and loader_rows == []
    assert all(r.get("skipped") == "tune.budget_s spent" for r in prec_rows)
    assert len(p.pace.skipped) == 5 + 6
    assert p.pace.lines[-1] == ("chose batch_size 4, loader dataloader, num_workers 3, "
                                "prefetch_factor 5, precision bf16, channels_last False, "
                                "compile False (11 candidate(s) skipped: budget)")


def test_with_no_budget_at_all_the_largest_fitting_batch_and_the_device_loader(tmp_path,
                                                                              clock, cores):
    p = make_probe(tmp_path, budget_s=0.0, stage=lambda st: dataclasses.replace(
        st, channels_last=True))
    s = Scripted(p, clock)
    choice, batch_rows, loader_rows, prec_rows = tune.choose(p, 12, "fp32", device_ok=True)
    assert choice == {"batch_size": 12, "loader": "device", "num_workers": 3,
                      "prefetch_factor": 5, "precision": "fp32", "channels_last": True,
                      "compile": False}
    assert (s.calls, batch_rows, loader_rows) == ([], [], [])
    assert len(prec_rows) == 6


def test_a_precision_row_that_did_not_fit_is_never_chosen(tmp_path, clock, cores):
    """fp16 does not fit at the chosen batch: it has no throughput, and the fastest of the
    rows measured wins."""
    p = make_probe(tmp_path)
    s = Scripted(p, clock, need=lambda prec, cl: None if prec == "fp16" else MiB,
                 rate=lambda c: 200.0 if (c[4], c[5]) == ("bf16", True) else 100.0)
    choice, _, _, prec_rows = tune.choose(p, 2, "fp32", device_ok=False)
    assert (choice["precision"], choice["channels_last"]) == ("bf16", True)
    assert [r["fits"] for r in prec_rows] == [True] * 4 + [False] * 2
    assert "fp16" not in [c[4] for c in s.calls]
