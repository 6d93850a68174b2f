from ddpflow.cli import entry

raise SystemExit(entry())
