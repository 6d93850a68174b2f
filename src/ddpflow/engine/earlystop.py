"""Early stopping and time-to-target (`stages[].stop: {monitor, patience, target}`).

After each validation the trainer calls `check(trainer, metrics)`:
- `target`: the first time the monitored metric reaches it (>= when maximized, <= when
  minimized), the step, epoch, training seconds and wall seconds since the launch are
  recorded (time-to-accuracy: the figure people compare) and the stage stops there;
- `patience`: that many validations in a row without a new best of the monitor stop it.

The monitor is the metric that chooses best.pt unless `stop.monitor` names another val_
metric. Every rank sees the same all-reduced metrics, so every rank decides the same with
no collective. The decision and the counters live in TrainState.stop, saved by the
checkpoint that follows, so a resume neither trains on after a stop nor forgets how many
validations went without improvement. A stopped stage is a finished stage: final.pt holds
the weights at the stop and the next stage starts from them.
"""

from __future__ import annotations

import time

from ddpflow.core.errors import UserError
from ddpflow.seams.tasks import metric_mode


def _monitor(t) -> tuple[str, str]:
    name = t.st.stop.get("monitor")
    if not name or name == t.monitor:
        return t.monitor, t.mode
    return name, metric_mode(name, t.task, "auto")


def check(t, metrics: dict) -> bool:
    """Update TrainState.stop after a validation; True when the stage stops here."""
    cfg, s = t.st.stop, t.state
    if cfg.get("patience") is None and cfg.get("target") is None:
        return False
    name, mode = _monitor(t)
    if name not in metrics:
        i = t.cfg.stage_index(t.st.name)
        raise UserError(f"stages.{i}.stop.monitor {name} is not a validation metric of task "
                        f"{t.cfg.task.name}; it reports {', '.join(metrics)}")
    value, st = metrics[name], s.stop
    better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)
    if st.get("best") is None or better(value, st["best"]):
        st["best"], st["bad_validations"] = value, 0
    else:
        st["bad_validations"] = st.get("bad_validations", 0) + 1
    target = cfg.get("target")
    if target is not None and "target" not in st and (
            value >= target if mode == "max" else value <= target):
        st["target"] = {"monitor": name, "target": target, "value": value, "step": s.step,
                        "epoch": s.epoch + 1,
                        "train_time_s": round(s.elapsed_s + time.perf_counter() - t.t_start, 3),
                        "wall_time_s": round(time.time() - t.clock.t0
                                             + sum(s.wall_s.values()), 3)}
        st["stopped"] = {"reason": f"{name} {value:.4g} reached the target {target:g}",
                         "step": s.step, "epoch": s.epoch + 1}
    elif cfg.get("patience") is not None and st["bad_validations"] >= cfg["patience"]:
        st["stopped"] = {"reason": f"{name} did not improve on {st['best']:.4g} for "
                                   f"{st['bad_validations']} validation(s) (patience "
                                   f"{cfg['patience']})", "step": s.step, "epoch": s.epoch + 1}
    if "stopped" in st:
        t.say(f"stopping early at step {s.step}: {st['stopped']['reason']}")
        return True
    return False


def summary(t) -> dict:
    """The summary.json keys: early_stop (the reason, or None) and target (time-to-target)."""
    st = t.state.stop
    return {"early_stop": st.get("stopped"), "target": st.get("target"),
            "time_to_target_s": (st.get("target") or {}).get("wall_time_s")}
