"""bench/gpu.sh's `flight_recorder` check: NCCL's flight recorder, as the launcher sets it up
(launch/hangreport.flight_recorder), writes its dump when a collective times out, and the
launcher's NCCL-only report (hangreport._flight_recorder_only) names it.

    torchrun --standalone --nproc-per-node 1 bench/gpu_flight.py OUT      (the hang: aborts)
    python bench/gpu_flight.py OUT --read                                 (the verdict)

One GPU is enough: NCCL refuses two ranks on one GPU, so the collective that never
completes is made on one rank by a kernel that spins (torch.cuda._sleep) ahead of it on the
device: the all-reduce is queued behind it, NCCL's watchdog sees it pass its timeout, dumps
the flight recorder's buffer and ends the process, as it does for a rank that never arrives.
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

from ddpflow.engine.heartbeat import RANKS
from ddpflow.launch import hangreport

TIMEOUT_S = 10  # the process group's timeout: the watchdog's deadline for the stuck one
COMPLETED = 5  # all-reduces that complete before the stuck one


def hang(out: Path) -> None:
    import torch
    import torch.distributed as dist

    # read when the process group is made
    os.environ.update(hangreport.flight_recorder(out, torch.__version__))
    (out / RANKS).mkdir(parents=True, exist_ok=True)

    dist.init_process_group("nccl", timeout=timedelta(seconds=TIMEOUT_S),
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(COMPLETED):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"{COMPLETED} all-reduces done; now one behind a spinning kernel", flush=True)
    torch.cuda._sleep(int(1.2e11))  # about a minute at 2 GHz: it ends even if nothing kills it
    dist.all_reduce(x)
    x.cpu()  # waits; NCCL's watchdog should time the all-reduce out and end this process
    print("the stuck all-reduce completed: the watchdog did not end the process", flush=True)


def read(out: Path) -> int:
    dumps = sorted((out / RANKS).glob(hangreport.FLIGHT_PREFIX + "*"))
    print("dumps:", [p.name for p in dumps])
    if not dumps:
        print("figure: no flight recorder dump was written")
        return 1
    with open(dumps[0], "rb") as f:
        trace = pickle.load(f)
    entries = trace.get("entries", [])
    last = entries[-1] if entries else {}
    states = [e.get("state") for e in entries]
    print("keys:", sorted(trace), "| entries:", len(entries), "| states:", states)
    print("last:", {k: last.get(k) for k in ("profiling_name", "state", "collective_seq_id",
                                             "timeout_ms")})
    said = hangreport._flight_recorder_only(out, None)
    print("report:", said)
    ok = (len(entries) >= COMPLETED + 1 and last.get("state") != "completed"
          and said is not None and "torchfrtrace" in said)
    print(f"figure: dump {dumps[0].name} ({dumps[0].stat().st_size} B), {len(entries)} "
          f"entries, last {last.get('profiling_name')} {last.get('state')}; "
          f"report {'names it' if said else 'missing'}")
    return 0 if ok else 1


if __name__ == "__main__":
    where = Path(sys.argv[1])
    sys.exit(read(where) if "--read" in sys.argv else hang(where))
