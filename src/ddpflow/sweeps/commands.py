"""`ddpflow sweep plan|list|schedule|collect`: what each action of the sweep command does."""

from __future__ import annotations

import sys

from ddpflow.config import Config
from ddpflow.core.errors import stop_raises


def command(cfg: Config, args) -> int:
    from ddpflow.sweeps import plan as planning

    if args.action == "collect":
        from ddpflow.sweeps.leaderboard import collect

        with stop_raises():  # a stopped collect keeps none of its part-written leaderboard
            text = collect(cfg, args.logs)
        print(text, end="")
        return 0
    if args.action == "schedule":
        from ddpflow.sweeps.scheduler import schedule

        return schedule(cfg, args.logs, args.via)
    trials = planning.plan(cfg)
    if args.action == "list":
        for trial, _ in trials:
            print(f"{trial.id}\t{planning._shown(trial)}")
        if cfg.sweep.search == "tpe":
            r = cfg.sweep.random
            print(f"# sweep.search tpe: up to {r['samples']} trial(s) drawn while the sweep runs "
                  f"(ddpflow sweep schedule), from {', '.join(r['space'])}")
        return 0
    path = planning.write_plan(cfg, trials)
    shared = len({t["data"]["prepared_dir"] for _, t in trials})
    print(f"ddpflow: sweep of {len(trials)} trial(s), {shared} prepared dataset(s): {path}",
          file=sys.stderr)
    return 0
