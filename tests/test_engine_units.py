"""Small engine and launch pieces, each on its own: a rank's stop flag (a real process and
real signals), TrainState from a checkpoint, a stage's stamp, and the halt options `ddpflow
launch` passes its ranks. Fast: no training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine.state import StageFiles, TrainState
from ddpflow.launch.halting import rank_args

FLAG = """
import os, signal
from ddpflow.engine import stopflag
print(stopflag.received())
stopflag.install()
print(stopflag.received())
os.kill(os.getpid(), signal.{first})
os.kill(os.getpid(), signal.{second})
print(stopflag.received())
"""


@pytest.mark.parametrize("first, second", [("SIGUSR1", "SIGTERM"), ("SIGTERM", "SIGUSR1")])
def test_a_stop_signal_only_sets_the_flag_and_the_first_one_is_kept(first, second):
    """SIGTERM and SIGUSR1 would end the process; installed, they only set the flag, and the
    first one received is the one reported."""
    out = subprocess.run([sys.executable, "-c", FLAG.format(first=first, second=second)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", first]


def test_train_state_takes_the_checkpoints_fields_and_defaults_the_rest():
    s = TrainState.from_checkpoint({"step": 7, "epoch": 2, "best": {"value": 0.5},
                                    "model": "tensors are not state", "world": 4})
    assert (s.step, s.epoch, s.best, s.world) == (7, 2, {"value": 0.5}, 4)
    assert (s.step_in_epoch, s.elapsed_s, s.runs, s.stop, s.accum) == (0, 0.0, 0, {}, 0)
    a, b = TrainState(), TrainState()
    a.best["x"] = 1
    assert b.best == {}  # no state shared between two of them


def test_a_stage_stamps_its_identity_and_keeps_checkpoints_under_its_folder(tmp_path):
    f = StageFiles(stage="s1", out=tmp_path / "stages" / "s1", config={"a": 1},
                   config_hash="c", stage_hash="h", record={"r": 2}, resume_key="k",
                   monitor="val_acc", mode="max")
    assert f.ckpt_dir == tmp_path / "stages" / "s1" / "checkpoints"
    assert f.stamp() == {"stage": "s1", "config": {"a": 1}, "config_hash": "c",
                         "stage_hash": "h", "resume_key": "k", "record": {"r": 2}}


def _stage(tmp_path: Path, **st):
    cfg = tiny_config(tmp_path)
    cfg["stages"] = [{**cfg["stages"][0], **st}]
    return from_dict(cfg).stages[0]


def test_halt_options_reach_the_ranks_as_given(tmp_path):
    st = _stage(tmp_path, epochs=3)
    assert rank_args(st, None, None) == []
    assert rank_args(st, 5, None) == ["--halt-after-steps=5"]
    assert rank_args(st, None, 1) == ["--halt-after-epochs=1"]
    assert rank_args(st, None, 2) == ["--halt-after-epochs=2"]
    assert rank_args(st, 4, 2) == ["--halt-after-steps=4", "--halt-after-epochs=2"]


@pytest.mark.parametrize("epochs, halt, words", [
    (3, 3, "trains 3 epoch(s); give 1..2 (or leave the option out"),  # its end: no pause
    (3, 0, "trains 3 epoch(s); give 1..2"),
    (1, 1, "trains 1 epoch(s); give 1..0"),
])
def test_a_halt_the_stage_cannot_make_is_one_message(tmp_path, epochs, halt, words):
    st = _stage(tmp_path, epochs=epochs, name="warm")
    with pytest.raises(UserError) as e:
        rank_args(st, None, halt)
    assert str(e.value).startswith(f"--halt-after-epochs {halt}: stage 'warm' {words}"), e.value


def test_a_stage_measured_in_steps_has_no_epoch_halt(tmp_path):
    st = _stage(tmp_path, name="warm", max_steps=12)
    with pytest.raises(UserError) as e:
        rank_args(st, None, 1)
    assert str(e.value) == ("--halt-after-epochs 1: stage 'warm' is measured in steps "
                            "(max_steps 12); use --halt-after-steps")


# ------------------------------------------------------------------ core/errors.py

def test_sigterm_inside_stop_raises_is_an_exception_and_the_old_handler_returns():
    import os
    import signal

    from ddpflow.core.errors import Stopped, stop_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as e:
        with stop_raises():
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not raise")
    assert e.value.signum == signal.SIGTERM and e.value.args == (signal.SIGTERM,)
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_op_without_a_deterministic_kernel_is_named_and_other_errors_are_not():
    from ddpflow.core.errors import nondeterministic

    e = RuntimeError("upsample_bilinear2d_backward_out_cuda does not have a deterministic "
                     "implementation, but you set 'torch.use_deterministic_algorithms(True)'")
    user = nondeterministic(e, "resnet18")
    assert str(user) == ("deterministic: true, but model resnet18 runs "
                         "upsample_bilinear2d_backward_out_cuda, which has no deterministic "
                         "kernel on this device; set deterministic: false (results then vary "
                         "slightly from run to run), or replace the layer that calls it")
    assert isinstance(user, UserError)
    wrapped = RuntimeError("in the first step: index_add_cuda_ does not have a deterministic "
                           "implementation, but you set it")
    assert "runs index_add_cuda_, which" in str(nondeterministic(wrapped, "m"))
    assert nondeterministic(RuntimeError("CUDA out of memory"), "m") is None
    assert nondeterministic(ValueError(str(e)), "m") is None


# ------------------------------------------------------------------ launch/agent.py

def test_the_warm_agent_runs_torchrun_with_the_args_and_env_it_is_sent(tmp_path):
    """The launcher's pipe: nothing sent, it exits at once; a job, it runs torchrun with
    exactly that environment (the agent's own is replaced) and those arguments."""
    import json
    import os

    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('PROBE', '-')"
                      " + ' ' + os.environ.get('LEAK', 'gone') + ' ' + os.environ['RANK'])\n")

    def agent(job: bytes) -> subprocess.CompletedProcess:
        r, w = os.pipe()
        env = {**os.environ, "LEAK": "kept"}
        p = subprocess.Popen([sys.executable, "-m", "ddpflow.launch.agent", str(r)],
                             pass_fds=(r,), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        os.close(r)
        os.write(w, job)
        os.close(w)
        out, err = p.communicate(timeout=300)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    assert agent(b"").returncode == 0
    assert not (tmp_path / "out").exists()
    env = {k: v for k, v in os.environ.items() if k != "LEAK"}
    job = {"env": {**env, "PROBE": "sent"},
           "args": ["--nproc-per-node=1", "--standalone", str(script), str(tmp_path / "out")]}
    done = agent(json.dumps(job).encode())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out").read_text() == "sent gone 0"


@pytest.mark.parametrize("value, limit, text", [
    ("a" * 8, 10, "'aaaaaaaa'"),  # its repr is 10 characters: whole
    ("a" * 9, 10, "'aaaa ..."),  # 11: cut to 10, the cut said
    (list(range(100)), 20, "[0, 1, 2, 3, 4, ..."),
])
def test_a_value_in_a_message_is_its_repr_capped(value, limit, text):
    from ddpflow.core.errors import short

    assert short(value, limit) == text and len(text) <= limit
