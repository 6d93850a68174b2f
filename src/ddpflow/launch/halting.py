"""Where `ddpflow launch` may pause a stage before its end, as the ranks' arguments.

`--halt-after-steps N` checkpoints after optimizer step N (mid-epoch, before validation);
`--halt-after-epochs N` after epoch N's validation and checkpoint: what a sweep's scheduler
(sweeps/scheduler.py) pauses a trial at, one rung at a time. Either resumes exactly: the
same command without the option continues from the checkpoint.
"""

from __future__ import annotations

from ddpflow.core.errors import UserError


def rank_args(stage, halt_after_steps: int | None, halt_after_epochs: int | None) -> list[str]:
    """The halt options for `ddpflow train` on every rank; a UserError for a halt the stage
    `st` (a StageCfg) cannot make: its own end is not a pause."""
    if halt_after_epochs is not None:
        if stage.max_steps is not None:
            raise UserError(f"--halt-after-epochs {halt_after_epochs}: stage '{stage.name}' is "
                            f"measured in steps (max_steps {stage.max_steps}); use "
                            f"--halt-after-steps")
        if not 1 <= halt_after_epochs < stage.epochs:
            raise UserError(f"--halt-after-epochs {halt_after_epochs}: stage '{stage.name}' "
                            f"trains {stage.epochs} epoch(s); give 1..{stage.epochs - 1} (or leave "
                            f"the option out to run it to its end)")
    return [f"--{name}={value}" for name, value in (
        ("halt-after-steps", halt_after_steps), ("halt-after-epochs", halt_after_epochs))
        if value is not None]
