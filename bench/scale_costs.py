"""How the per-step and per-save costs grow: all-reduce time against parameter count and
ranks (gloo), checkpoint size and write time against parameter count, and host memory per
rank against dataset size for each loader.

    python bench/scale_costs.py [--params 1e6,1e7,2.56e7,1e8] [--ranks 2,4]
                                [--images 4096,16384,65536]

all-reduce: `torchrun --standalone` with R gloo ranks (one thread each, on this machine's
cores), one flat fp32 tensor of P elements summed, the median of 5 after one warm-up;
bus bandwidth = 2 (R-1)/R x bytes / time (nccl-tests' definition), comparable to
published NCCL figures. DDP all-reduces the same bytes in 25 MB buckets, overlapped with
the backward pass.
checkpoint: ddpflow's own save path (checkpoint.save_file: torch.save to memory, SHA-256,
write, fsync, rename, fsync of the folder) of {model: P floats, optimizer momentum: P
floats} (SGD with momentum; AdamW adds another P), and HostCopy (the part a step waits
for). Median of 3.
host memory: one rank of two builds the training batches of a prepared split of N
synthetic 32 px images (x 1.15 store for jpeg) and reads one epoch; /proc/self/smaps_rollup
splits its memory into private (Anonymous: copies this rank holds alone) and file-backed
(page cache pages of the memory map, shared by every rank on the node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def allreduce_worker(sizes: list[int]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for n in sizes:
        t = torch.ones(n)
        dist.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append({"params": n, "ranks": world, "seconds": statistics.median(times)})
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def allreduce(sizes: list[int], ranks: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", __file__, "--allreduce-worker",
           "--params", ",".join(map(str, sizes))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def checkpoint_cost(sizes: list[int], folder: Path) -> list[dict]:
    from ddpflow.engine.checkpoint import HostCopy, save_file

    rows = []
    for n in sizes:
        state = {"model": {"w": torch.randn(n)}, "optimizer": {"momentum": torch.randn(n)}}
        copy, copies, writes = HostCopy(), [], []
        for i in range(3):
            t0 = time.perf_counter()
            host = copy(state)
            copy.finish()
            copies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            save_file(folder / f"ckpt-{i}.pt", host)
            writes.append(time.perf_counter() - t0)
        size = (folder / "ckpt-0.pt").stat().st_size
        for p in folder.iterdir():
            p.unlink()
        rows.append({"params": n, "bytes": size, "copy_s": statistics.median(copies),
                     "write_s": statistics.median(writes)})
    return rows


def _rollup() -> dict[str, int]:
    with open("/proc/self/smaps_rollup") as f:
        return {k.rstrip(":"): int(v) * 1024 for k, v, *_ in (line.split() for line in f)
                if k.endswith(":") and v.isdigit()}


def memory_worker(data_dir: str, kind: str) -> None:
    from ddpflow.config.types import AugmentCfg
    from ddpflow.data import prepared
    from ddpflow.data.loaders import Normalize, TrainBatches, read_rows

    torch.set_num_threads(1)
    meta, arrays = prepared.load(Path(data_dir))
    read_rows(*arrays["train"], [0])  # imports (torchvision's decoder) before the baseline
    before = _rollup()
    norm = Normalize(meta["mean"], meta["std"], torch.device("cpu"), 3, False)
    tb = TrainBatches(kind, *arrays["train"], 128, torch.device("cpu"), 2, 0, 0,
                      AugmentCfg(4, True, 0, None), norm, num_workers=0, image_size=32)
    for _ in tb.epoch(0):
        pass
    after = _rollup()
    rss = after["Rss"] - before["Rss"]
    anon = after["Anonymous"] - before["Anonymous"]
    print("RESULT " + json.dumps({"private": anon, "file": rss - anon}), flush=True)


def memory(images: list[int], work: Path) -> list[dict]:
    from ddpflow.config import from_dict
    from ddpflow.data.prepare import prepare

    rows = []
    for n in images:
        for enc, store in (("raw", 32), ("jpeg", 38)):
            cfg = from_dict({"run": f"m{n}{enc}", "results_dir": str(work), "data": {
                "source": "synthetic", "train_size": n, "val_size": 256, "test_size": 0,
                "image_size": 32, "store_size": store, "encoding": enc},
                "stages": [{"name": "s"}]})
            meta, _ = prepare(cfg)
            kinds = ("device", "dataloader") if enc == "raw" else ("dataloader",)
            for kind in kinds:
                proc = subprocess.run([sys.executable, __file__, "--memory-worker",
                                       str(cfg.data_dir), kind], capture_output=True,
                                      text=True, check=True)
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                rows.append({"images": n, "loader": f"{kind} ({enc})",
                             "dataset_bytes": meta["bytes_written"],
                             **json.loads(line[len("RESULT "):])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="1e6,1e7,2.56e7,1e8")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--images", default="4096,16384,65536")
    ap.add_argument("--allreduce-worker", action="store_true")
    ap.add_argument("--memory-worker", nargs=2, metavar=("DATA_DIR", "LOADER"))
    args = ap.parse_args()
    sizes = [int(float(x)) for x in args.params.split(",")]
    if args.allreduce_worker:
        return allreduce_worker(sizes)
    if args.memory_worker:
        return memory_worker(*args.memory_worker)
    with tempfile.TemporaryDirectory(prefix="ddpflow-costs-") as tmp:
        ar = [r for ranks in map(int, args.ranks.split(",")) for r in allreduce(sizes, ranks)]
        ck = checkpoint_cost(sizes, Path(tmp))
        mem = memory([int(x) for x in args.images.split(",")], Path(tmp) / "mem")
    report(ar, ck, mem)


def report(ar, ck, mem) -> None:
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, gloo")
    print("all-reduce (fp32): params  ranks  ms  bus GB/s")
    for r in ar:
        b = 4 * r["params"]
        bus = 2 * (r["ranks"] - 1) / r["ranks"] * b / r["seconds"] / 1e9
        print(f"  {r['params']:>11,}  {r['ranks']}  {r['seconds'] * 1e3:9.1f}  {bus:6.2f}")
    print("checkpoint (model + momentum): params  MB  host copy ms  write s  write MB/s")
    for r in ck:
        print(f"  {r['params']:>11,}  {r['bytes'] / 1e6:8.1f}  {r['copy_s'] * 1e3:8.1f}  "
              f"{r['write_s']:7.2f}  {r['bytes'] / 1e6 / r['write_s']:7.0f}")
    print("host memory of one rank's loader after an epoch: images  loader  dataset MB  "
          "private MB  file-backed (shared) MB")
    for r in mem:
        print(f"  {r['images']:>7}  {r['loader']:<18} {r['dataset_bytes'] / 1e6:8.1f}  "
              f"{r['private'] / 1e6:8.1f}  {r['file'] / 1e6:8.1f}")


if __name__ == "__main__":
    main()
