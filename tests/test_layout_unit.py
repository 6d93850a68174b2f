"""`channels_last: auto` as engine/layout.py decides it, on the CPU with real models: which
models qualify (2-D convolutions), what one timing is (a warm-up, then the best of the timed
forward + backward passes, the GPU synchronised around each clock reading), what a probe
returns and leaves behind (the model as it was, the error of a model that fails in
channels_last), the answer and its reason for every setting, the two caches a probe is kept
in (the run folder's first, then the user's), the stage's probe shape, and the input hook of a
model trained in channels_last. Then engine/memory.py's CPU-testable parts: the search for
the largest batch that fits, what counts as an OOM, the input pipeline's and the wrapper's
bytes, a rank's memory record and resident set, and a rank's memory budget (torch.cuda
stands in for the allocator a GPU rank's cap is given to). Fast: tiny tensors, no training.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.engine import distributed, layout, memory, runtime
from ddpflow.seams.models import MLP, SmallCNN

CPU = torch.device("cpu")
OFF = torch.autocast("cpu", enabled=False)


def _dist(device: str = "cpu") -> distributed.Dist:
    return distributed.Dist(0, 0, 1, torch.device(device), None)


def _name(shape, key, deterministic=False, device="cpu") -> str:
    """The cache key decide() files a probe under (what the docs promise it depends on)."""
    return json.dumps({**key, "shape": list(shape), "threads": torch.get_num_threads(),
                       "host": socket.gethostname(), "device": device,
                       "timed": not deterministic}, sort_keys=True)


class _Formats(nn.Module):
    """A convnet that logs, at each forward, whether its weight and its input are in
    channels_last, and (from a gradient hook) each backward."""

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv.weight.register_hook(lambda g: log.append("backward"))

    def forward(self, x):
        cl = torch.channels_last
        self.log.append(("forward", self.conv.weight.is_contiguous(memory_format=cl),
                         x.is_contiguous(memory_format=cl)))
        return self.conv(x).mean(dim=(2, 3))


class _Raises(nn.Module):
    """Fine in NCHW; in channels_last raises a RuntimeError with a long first line."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            raise RuntimeError("v" * 300 + "\nsecond line")
        return self.conv(x).sum(dim=(2, 3))


class _Pair(nn.Module):
    """Returns a tuple: nothing simple to backpropagate; `only_cl`: only in channels_last."""

    def __init__(self, only_cl=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.only_cl = only_cl

    def forward(self, x):
        out = self.conv(x).sum(dim=(2, 3))
        cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return (out, out) if cl or not self.only_cl else out


# ------------------------------------------------------------------ which models qualify
def test_only_models_with_2d_convolutions_qualify():
    assert layout.has_conv2d(SmallCNN(10, 3)) is True
    assert layout.has_conv2d(nn.Sequential(nn.ConvTranspose2d(3, 3, 2))) is True
    assert layout.has_conv2d(MLP(10, 3)) is False
    assert layout.has_conv2d(nn.Sequential(nn.Conv1d(3, 3, 2), nn.Conv3d(3, 3, 2))) is False


# ------------------------------------------------------------------ one timing
class _Clock:
    """time.perf_counter for layout, reading scripted instants (a probe's timings are exact
    whatever the machine's load); logs each reading next to the syncs and passes."""

    def __init__(self, log, instants):
        self.log, self.instants = log, list(instants)

    def perf_counter(self):
        self.log.append("clock")
        return self.instants.pop(0)


def _timed(monkeypatch, instants, reps, model_log=None):
    log = [] if model_log is None else model_log
    monkeypatch.setattr(layout, "time", _Clock(log, instants))
    monkeypatch.setattr(layout, "_sync", lambda dev: log.append(("sync", dev.type)))
    model = _Formats(log)
    got = layout._step_seconds(model, torch.randn(2, 3, 4, 4), OFF, reps)
    return got, log, model


def test_a_timing_is_the_best_timed_pass_after_a_warm_up(monkeypatch):
    # a warm-up (not timed), then timed passes of 3, 1 and 2 s: the best is 1 s
    got, log, model = _timed(monkeypatch, [0, 10, 13, 20, 21, 30, 32], 3)
    assert got == 1.0
    one = [("sync", "cpu"), "clock", ("forward", False, False), "backward", ("sync", "cpu"),
           "clock"]
    assert log == one[:-1] + one * 3  # each clock reading after a synchronize
    assert model.conv.weight.grad is None and model.conv.bias.grad is None  # nothing kept


def test_deterministic_mode_times_the_one_pass(monkeypatch):
    got, log, _ = _timed(monkeypatch, [5, 7.5], 0)
    assert got == 2.5 and log.count("backward") == 1


def test_a_model_without_a_tensor_output_is_not_timed():
    assert layout._step_seconds(_Pair(), torch.randn(2, 3, 4, 4), OFF, 0) is None
    got = layout._step_seconds(_Pair(only_cl=True), torch.randn(2, 3, 4, 4), OFF, 0)
    assert isinstance(got, float) and got >= 0


def test_the_clock_waits_for_the_gpu_only_on_a_gpu(monkeypatch):
    """torch.cuda.synchronize stands in here (no GPU on a CPU runner): the device it gets."""
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", seen.append)
    layout._sync(CPU)
    assert seen == []
    layout._sync(torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 1)]


def test_the_device_name_in_the_cache_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: f"Fake GPU {dev.index}")
    assert layout.device_name(CPU) == "cpu"
    assert layout.device_name(torch.device("cuda", 0)) == "Fake GPU 0"


# ------------------------------------------------------------------ a probe
def test_a_probe_times_both_layouts_and_leaves_the_model_as_it_was():
    log = []
    model = _Formats(log)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    got = layout.probe(model, (2, 3, 5, 5), OFF, CPU, reps=0)
    after = torch.rand(4)  # a run that probed draws what a run reading the cache draws
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))
    assert set(got) == {"batch", "channels_last_error", "nchw_s", "channels_last_s"}
    assert got["batch"] == 2 and got["channels_last_error"] is None
    assert got["nchw_s"] >= 0 and got["channels_last_s"] >= 0
    # one pass in NCHW, then one with the weights and the input in channels_last
    assert log == [("forward", False, False), "backward", ("forward", True, True), "backward"]
    assert model.conv.weight.is_contiguous() and model.conv.weight.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_that_fails_in_channels_last_is_probed_with_the_reason():
    model = _Raises()
    got = layout.probe(model, (3, 3, 4, 4), OFF, CPU, reps=0)
    assert got["batch"] == 3 and got["channels_last_s"] is None and got["nchw_s"] >= 0
    assert got["channels_last_error"] == "RuntimeError: " + "v" * 200  # first line, 200 chars
    assert model.conv.weight.is_contiguous() and model.conv.weight.grad is None


def test_a_probe_of_a_model_without_a_tensor_output_is_none():
    assert layout.probe(_Pair(), (2, 3, 4, 4), OFF, CPU, reps=0) is None
    assert layout.probe(_Pair(only_cl=True), (2, 3, 4, 4), OFF, CPU, reps=0) is None


# ------------------------------------------------------------------ the decision
def _decide(tmp_path, setting, model, deterministic=False, device="cpu", shape=(2, 3, 4, 4)):
    return layout.decide(setting, model, _dist(device), shape, OFF, deterministic,
                         tmp_path / "run" / "layout.json", {"model": "m"})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "ddpflow" / "layout.json"


def test_a_set_layout_is_the_config_s(tmp_path, cache):
    assert _decide(tmp_path, True, MLP(10, 3)) == (True, "channels_last: true in the config")
    assert _decide(tmp_path, False, SmallCNN(10, 3)) == (False,
                                                         "channels_last: false in the config")
    assert _decide(tmp_path, "auto", MLP(10, 3)) == (False,
                                                     "auto: the model has no 2-D convolution")
    assert not (tmp_path / "run").exists() and not cache.exists()  # nothing probed


def _keep(path: Path, name: str, kept) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({name: kept}))


@pytest.mark.parametrize("nchw_s, cl_s, on, ratio", [
    (2.1, 2.0, True, "1.05"),  # just the margin
    (2.0, 2.0, False, "1.00"),
    (2e-12, 0.0, True, "2.00"),  # a clock too coarse to see the step: no division by zero
    (1.0, 2.0, False, "0.50")])
def test_auto_takes_channels_last_when_it_wins_by_the_margin(tmp_path, cache, nchw_s, cl_s,
                                                            on, ratio):
    shape = (2, 3, 4, 4)
    _keep(tmp_path / "run" / "layout.json", _name(shape, {"model": "m"}),
          {"nchw_s": nchw_s, "channels_last_s": cl_s, "channels_last_error": None, "batch": 2})
    assert _decide(tmp_path, "auto", SmallCNN(10, 3)) == (
        on, f"auto: a probe on this CPU at batch 2, channels_last at {ratio}x the speed of "
            "NCHW (kept in layout.json)")


def test_a_gpu_s_reason_names_the_gpu(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Fake H100")
    shape = (4, 3, 4, 4)
    _keep(tmp_path / "run" / "layout.json", _name(shape, {"model": "m"}, device="Fake H100"),
          {"nchw_s": 1.0, "channels_last_s": 2.0, "channels_last_error": "RuntimeError: x",
           "batch": 4})
    assert _decide(tmp_path, "auto", SmallCNN(10, 3), device="cuda", shape=shape) == (
        False, "auto: the model fails in channels_last (a probe on this GPU (Fake H100) at "
               "batch 4: RuntimeError: x); NCHW")


def test_auto_probes_and_keeps_the_answer_in_both_caches(tmp_path, cache):
    log = []
    on, why = _decide(tmp_path, "auto", _Formats(log))
    assert log.count("backward") == 8  # a warm-up and three timed passes, in each layout
    run = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert list(run) == [_name((2, 3, 4, 4), {"model": "m"})]
    assert json.loads(cache.read_text()) == run
    kept = run[_name((2, 3, 4, 4), {"model": "m"})]
    assert on == (kept["nchw_s"] / kept["channels_last_s"] >= layout.MARGIN)
    assert why.startswith("auto: a probe on this CPU at batch 2, channels_last at "), why
    # a later process takes the kept answer: no probe
    assert _decide(tmp_path, "auto", _Formats(log)) == (on, why) and len(log) == 16


def test_deterministic_mode_runs_one_pass_in_each_layout(tmp_path, cache):
    log = []
    assert _decide(tmp_path, "auto", _Formats(log), deterministic=True) == (
        True, "auto: 2-D convolutions (deterministic mode: no timing probe)")
    assert log.count("backward") == 2
    run = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert list(run) == [_name((2, 3, 4, 4), {"model": "m"}, deterministic=True)]
    assert _decide(tmp_path, "auto", _Raises(), deterministic=True, shape=(3, 3, 4, 4)) == (
        False, "auto: the model fails in channels_last (a probe on this CPU at batch 3: "
               f"RuntimeError: {'v' * 200}); NCHW")


def test_a_model_without_a_tensor_output_trains_in_nchw(tmp_path, cache):
    assert _decide(tmp_path, "auto", _Pair()) == (
        False, "auto: the model's output is not a tensor, so no probe; NCHW")
    name = _name((2, 3, 4, 4), {"model": "m"})
    assert json.loads((tmp_path / "run" / "layout.json").read_text()) == {name: None}
    assert json.loads(cache.read_text()) == {name: None}


# ------------------------------------------------------------------ the two caches
def test_the_run_folder_s_answer_comes_first_and_fills_the_user_s(tmp_path):
    run, user = tmp_path / "run" / "layout.json", tmp_path / "user" / "layout.json"
    a = {"nchw_s": 1.0, "channels_last_s": 2.0}
    b = {"nchw_s": 3.0, "channels_last_s": 4.0}
    _keep(run, "k", a)
    _keep(user, "k", b)
    model = _Raises()  # would say so if it were probed
    assert layout._rank0_answer("k", (run, user), model, (2, 3, 4, 4), OFF, CPU, 0) == a
    assert json.loads(user.read_text()) == {"k": b}  # each kept as it was
    run.unlink()
    assert layout._rank0_answer("k", (run, user), model, (2, 3, 4, 4), OFF, CPU, 0) == b
    assert json.loads(run.read_text()) == {"k": b}  # the run's later processes take it
    user.unlink()
    assert layout._rank0_answer("k", (run, user), model, (2, 3, 4, 4), OFF, CPU, 0) == b
    assert json.loads(user.read_text()) == {"k": b}


def test_the_user_cache_is_under_xdg_cache_home_or_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert layout.user_cache() == tmp_path / "x" / "ddpflow" / "layout.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.setenv("XDG_CACHE_HOME", ""),
                  lambda: monkeypatch.delenv("XDG_CACHE_HOME")):
        unset()
        assert layout.user_cache() == tmp_path / "home" / ".cache" / "ddpflow" / "layout.json"


def test_a_cache_keeps_every_answer_and_an_unwritable_one_is_skipped(tmp_path):
    path = tmp_path / "a" / "b" / "layout.json"
    layout._write(path, "one", {"nchw_s": 1.0, "channels_last_s": None})
    layout._write(path, "two", None)
    assert json.loads(path.read_text()) == {"one": {"nchw_s": 1.0, "channels_last_s": None},
                                           "two": None}
    assert layout._read(path) == {"one": {"nchw_s": 1.0, "channels_last_s": None},
                                  "two": None}
    (tmp_path / "file").write_text("")
    layout._write(tmp_path / "file" / "ddpflow" / "layout.json", "one", None)  # no error
    assert (tmp_path / "file").read_text() == ""


def test_a_missing_or_damaged_cache_reads_as_empty(tmp_path):
    path = tmp_path / "layout.json"
    assert layout._read(path) == {}
    path.write_text('{"k": {"nchw_s": -1, "channels_last_s": 1}}')  # not a measurement
    assert layout._read(path) == {}
    path.write_text("{")
    assert layout._read(path) == {}


# ------------------------------------------------------------------ a training stage
def test_a_stage_probes_at_its_batch_and_image_size(tmp_path, cache):
    cfg = from_dict(tiny_config(tmp_path, model={"name": "smallcnn", "kwargs": {}}))
    size = cfg.data.image_size
    assert layout.for_stage("auto", cfg, SmallCNN(10, 3), _dist(), 3, None, "fp32") == (
        False, "auto: the inputs are not images")
    assert layout.for_stage(True, cfg, MLP(10, 3), _dist(), 3, None, "fp32") == (
        True, "channels_last: true in the config")
    on, why = layout.for_stage("auto", cfg, SmallCNN(10, 3), _dist(), 3, 3, "bf16")
    assert why.startswith("auto: a probe on this CPU at batch 3") or why.startswith(
        "auto: 2-D convolutions"), why
    kept = json.loads((cfg.run_dir / "layout.json").read_text())
    key = {"model": "smallcnn", "kwargs": {}, "precision": "bf16"}
    assert list(kept) == [_name((3, 3, size, size), key, cfg.deterministic)]


# ------------------------------------------------------------------ channels_last inputs
class _Two(nn.Module):
    def forward(self, x=None, y=None):
        return x, y


def test_a_channels_last_model_takes_its_4d_input_in_channels_last():
    model = _Two()
    layout.channels_last_inputs(model)
    x, y = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    got_x, got_y = model(x, y)
    assert got_x.is_contiguous(memory_format=torch.channels_last) and torch.equal(got_x, x)
    assert got_y is y  # only the first input
    three = torch.randn(3, 4, 4)
    for other in (three, "label"):  # whatever follows it
        assert model(x, other)[0].is_contiguous(memory_format=torch.channels_last)
    assert model(three)[0] is three  # not an image batch: as it came
    assert model(x=x)[0] is x  # a keyword input: as it came
    assert model([x])[0][0] is x
    assert layout._to_channels_last(model, (x,))[0].is_contiguous(
        memory_format=torch.channels_last)
    assert layout._to_channels_last(model, (three,)) is None


# ================================================================== engine/memory.py
def test_the_largest_batch_that_fits_doubling_then_bisecting():
    def upto(n):
        calls = []

        def fits(b):  # a search that loops would try forever: at most 20 trials
            calls.append(b)
            assert len(calls) <= 20 and b >= 1, calls
            return b <= n
        return fits
    assert memory.find_max_batch(upto(37), 4, 100) == (37, [
        (4, True), (8, True), (16, True), (32, True), (64, False), (48, False), (40, False),
        (36, True), (38, False), (37, True)])
    assert memory.find_max_batch(upto(1000), 4, 50) == (50, [
        (4, True), (8, True), (16, True), (32, True), (50, True)])  # the limit, not 64
    assert memory.find_max_batch(upto(1000), 200, 50) == (50, [(50, True)])
    assert memory.find_max_batch(upto(1000), 0, 1) == (1, [(1, True)])
    # the start does not fit: 1, then bisection below the start
    assert memory.find_max_batch(upto(5), 16, 100) == (5, [
        (16, False), (1, True), (8, False), (4, True), (6, False), (5, True)])
    assert memory.find_max_batch(upto(0), 16, 100) == (0, [(16, False), (1, False)])
    assert memory.find_max_batch(upto(0), 1, 100) == (0, [(1, False)])  # 1 tried once
    # climb False after a fit ends the doubling there
    assert memory.find_max_batch(upto(1000), 4, 100, climb=lambda b: b < 8) == (8, [
        (4, True), (8, True)])


def test_only_allocation_failures_are_out_of_memory():
    assert memory.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert memory.is_oom(memory.SimulatedOOM("5 > 4 bytes"))
    for text in ("CUDA out of memory. Tried to allocate 2 GiB", "CUDNN_STATUS_ALLOC_FAILED",
                 "cuBLAS error: CUBLAS_STATUS_ALLOC_FAILED"):
        assert memory.is_oom(RuntimeError(text)), text
    assert not memory.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not memory.is_oom(ValueError("out of memory"))


def test_the_input_pipeline_s_bytes():
    # 3 rows of 10 x 12 x 3 uint8, and two float copies of 3 x 8 x 8 each
    assert memory.input_bytes(3, (10, 12, 3), 3, 8) == 3 * (360 + 2 * 4 * 3 * 64)
    assert memory.input_bytes(2, (5, 7, 1), 2, 3) == 2 * (35 + 2 * 4 * 2 * 9)


def test_what_the_wrapper_adds_to_the_plain_model_s_step():
    base = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))  # 440 + 88 bytes
    gloo4 = distributed.Dist(0, 0, 4, CPU, "gloo")
    assert memory.model_extra(base, [], gloo4, "ddp") == 528  # DDP's buckets
    assert memory.model_extra(base, [], distributed.Dist(0, 0, 1, CPU, None), "dp") == 0
    # FSDP: 3/4 of weights, grads and state saved; the biggest block gathered (x2)
    assert memory.model_extra(base, list(base), gloo4, "fsdp") == int(-3 * 528 * 0.75 + 880)
    assert memory.model_extra(base, [], gloo4, "fsdp") == int(-3 * 528 * 0.75 + 2 * 528)
    gloo2 = distributed.Dist(0, 0, 2, CPU, "gloo")
    assert memory.model_extra(base, list(base), gloo2, "fsdp") == int(-3 * 528 * 0.5 + 880)


def test_a_rank_s_bytes_of_tensors_and_optimizer_state():
    assert memory.local_bytes(torch.zeros(3, 4)) == 48
    assert memory.local_bytes(torch.zeros(3, 4, dtype=torch.float16)) == 24
    model = nn.Linear(3, 4)
    for opt, n in ((torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 1),
                   (torch.optim.Adam(model.parameters()), 2)):
        assert memory.state_bytes(opt) == 0
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert memory.state_bytes(opt) == n * (48 + 16)  # Adam's step counters left out


class _Held(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3 * 2**18))  # 3 MiB
        self.b = nn.Parameter(torch.zeros(2**17), requires_grad=False)  # 0.5 MiB, frozen


def test_a_rank_s_memory_record(monkeypatch):
    model = _Held()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.a.grad = torch.ones_like(model.a)
    opt.step()
    before = runtime.peak_memory_mib(CPU)
    got = memory.memory_record(model, opt, {"activations": 1.234567 * memory.MIB,
                                            "without_checkpointing": 2.345678 * memory.MIB},
                               CPU)
    after = runtime.peak_memory_mib(CPU)
    peak = got.pop("peak_mib")
    assert got == {"params_mib": 3.5, "grads_mib": 3.0, "optimizer_mib": 3.0,
                   "activations_mib": 1.23, "activations_without_checkpointing_mib": 2.35,
                   "process_start_mib": round(memory.START_RSS_MIB, 1)}
    assert round(before, 1) <= peak <= round(after, 1) and peak == round(peak, 1)
    got = memory.memory_record(model, opt, None, torch.device("meta"))  # not a CPU's peak
    assert got["activations_mib"] is None and got["process_start_mib"] is None
    assert got["activations_without_checkpointing_mib"] is None


def _vm_rss_mib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_the_process_s_resident_set(monkeypatch):
    got, status = memory.rss_mib(), _vm_rss_mib()
    assert abs(got - status) < 0.1 * status, (got, status)

    def unreadable(*a, **k):
        raise PermissionError("/proc/self/statm")
    monkeypatch.setattr(memory, "open", unreadable, raising=False)
    assert memory.rss_mib() == 0.0


def test_a_rank_s_budget_is_its_cap_or_the_free_memory():
    cap = [100, 0.5]
    assert memory.memory_budget(distributed.Dist(0, 0, 2, CPU, None), cap) == 100 * 2**20
    assert memory.memory_budget(distributed.Dist(1, 1, 2, CPU, None), cap) == 2**19
    assert memory.memory_budget(distributed.Dist(5, 1, 6, CPU, None), cap) == 2**19  # the last
    free = memory.memory_budget(distributed.Dist(0, 0, 1, CPU, None), None)
    assert isinstance(free, int) and free > 0


def test_a_gpu_rank_s_cap_is_enforced_by_the_allocator(monkeypatch):
    """torch.cuda stands in here (no GPU on a CPU runner): what the allocator is asked."""
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=4 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, dev: fractions.append((f, dev)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (3 * 2**30 + 0.5, 4 * 2**30))
    gpu = distributed.Dist(0, 0, 1, torch.device("cuda", 0), "nccl")
    assert memory.memory_budget(gpu, [1024]) == 2**30
    assert memory.memory_budget(gpu, [8192]) == 8 * 2**30
    assert fractions == [(0.25, torch.device("cuda", 0)), (1.0, torch.device("cuda", 0))]
    assert memory.memory_budget(gpu, None) == 3 * 2**30 and fractions[2:] == []
