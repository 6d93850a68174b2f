"""Early stopping and time-to-target (`stages[].stop: {monitor, patience, target}`).

After each validation the trainer calls `check(rule, state.stop, metrics, at)` and keeps
the stop record it returns:
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

from dataclasses import dataclass

from ddpflow.core.errors import UserError
from ddpflow.seams.tasks import metric_mode


@dataclass(frozen=True)
class StopRule:
    """A stage's `stop:` settings with its monitor resolved."""

    monitor: str
    mode: str  # max / min
    patience: int | None
    target: float | None
    where: str  # "stages.<i>" for messages
    task_name: str


def stop_rule(stop, where: str, task, task_name: str, monitor: str,
              mode: str) -> StopRule | None:
    """The rule of `stages[].stop` (None when neither patience nor target is set); the
    monitor is best.pt's (`monitor`, `mode`) unless stop.monitor names another metric."""
    if stop.patience is None and stop.target is None:
        return None
    if stop.monitor and stop.monitor != monitor:
        monitor, mode = stop.monitor, metric_mode(stop.monitor, task, "auto")
    return StopRule(monitor, mode, stop.patience, stop.target, where, task_name)


def check(rule: StopRule | None, so_far: dict, metrics: dict, at: dict) -> dict:
    """The stop record after one validation (a new dict; `so_far` is TrainState.stop).
    `at`: step, epoch (counted from 1), train_time_s and wall_time_s of this validation.
    The record has "stopped" once the stage stops here."""
    if rule is None:
        return so_far
    name, mode = rule.monitor, rule.mode
    if name not in metrics:
        raise UserError(f"{rule.where}.stop.monitor {name} is not a validation metric of task "
                        f"{rule.task_name}; it reports {', '.join(metrics)}")
    value, st = metrics[name], dict(so_far)
    if not isinstance(value, (int, float)):
        raise UserError(f"{rule.where}.stop.monitor {name} is one value per class, and "
                        f"stopping needs one number; monitor val_balanced_acc (their mean)")
    better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)
    if st.get("best") is None or better(value, st["best"]):
        st["best"], st["bad_validations"] = value, 0
    else:
        st["bad_validations"] = st.get("bad_validations", 0) + 1
    where = {"step": at["step"], "epoch": at["epoch"]}
    if rule.target is not None and "target" not in st and (
            value >= rule.target if mode == "max" else value <= rule.target):
        st["target"] = {"monitor": name, "target": rule.target, "value": value, **where,
                        "train_time_s": round(at["train_time_s"], 3),
                        "wall_time_s": round(at["wall_time_s"], 3)}
        st["stopped"] = {"reason": f"{name} {value:.4g} reached the target {rule.target:g}",
                         **where}
    elif rule.patience is not None and st["bad_validations"] >= rule.patience:
        st["stopped"] = {"reason": f"{name} did not improve on {st['best']:.4g} for "
                                   f"{st['bad_validations']} validation(s) (patience "
                                   f"{rule.patience})", **where}
    return st


def summary(stop: dict) -> dict:
    """The summary.json keys from TrainState.stop: early_stop (the reason, or None) and
    target (time-to-target)."""
    return {"early_stop": stop.get("stopped"), "target": stop.get("target"),
            "time_to_target_s": (stop.get("target") or {}).get("wall_time_s")}


def after_validation(rule, s, metrics: dict, t_start: float, wall_t0: float, say) -> dict:
    """Early stopping's record after a validation (`s`: TrainState; `t_start`: when this
    process's training began, perf_counter; `wall_t0`: its wall clock's start): the same
    decision on every rank (all see the same all-reduced metrics), no collective."""
    import time

    now = time.perf_counter()
    at = {"step": s.step, "epoch": s.epoch + 1,
          "train_time_s": s.elapsed_s + now - t_start,
          "wall_time_s": time.time() - wall_t0 + sum(s.wall_s.values())}
    stop = check(rule, s.stop, metrics, at)
    if "stopped" in stop:
        say(f"stopping early at step {s.step}: {stop['stopped']['reason']}")
    return stop
