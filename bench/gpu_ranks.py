"""bench/gpu.sh's 2-rank checks: what one rank never runs, on ddpflow's own helpers.

    torchrun --standalone --nproc-per-node 2 bench/gpu_ranks.py
    GPU_RANKS_BACKEND  gloo (both ranks on GPU 0: gloo takes CUDA tensors, so one GPU runs
                       it) or nccl (rank r on GPU r: needs 2 GPUs; NCCL refuses two ranks
                       on one GPU)
    GPU_RANKS_DEVICE   cuda (the GPU machine) or cpu (the CPU test suite runs the same
                       mechanism on 2 gloo ranks; SyncBatchNorm and compile are CUDA-only
                       here and reported as not exercised)
    GPU_RANKS_BREAK    parts' names (comma-separated): those parts are handed a wrong
                       expectation, so they must FAIL (the test suite's proof that their
                       assertions bite)

Rank 0 prints one line per part, `RESULT <part> PASS|FAIL|SKIP <figure or reason>`:
    collectives   all_sum, all_min, all_gather_floats, gather_objects, broadcast_object,
                  broadcast_buffers, reduce and gather_object (evaluate), new_subgroups:
                  each result exact
    ddp_no_sync   DDP (engine.distributed.wrap) with 2 micro-batches, the first under
                  no_sync: after it the gradient is the rank's own (no all-reduce), after
                  the second the mean of both ranks' sums, as a plain model computes them
    grad_hook     ordered_mean_hook (deterministic mode's): the same mean gradient
    fp16_skipped  GradScaler + grad clip + accumulation through engine.step.update: an inf
                  planted in rank 1's no_sync micro-batch at 2 of 8 steps reaches rank 0
                  through the all-reduce; skipped == 2 exactly, weights untouched on
                  exactly those steps, identical on both ranks
    syncbn        SyncBatchNorm (distributed.wrap, sync_bn): running stats and outputs as
                  one BatchNorm over both ranks' batches
    compile_ddp   torch.compile of the DDP model: graphs built, gradients as eager DDP's
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpflow.engine import distributed as D
from ddpflow.engine.step import update

BREAK = set(os.environ.get("GPU_RANKS_BREAK", "").split(","))


class Skip(Exception):
    """This part cannot run here (said as SKIP, and gpu.sh lists it as not exercised)."""


def setup() -> D.Dist:
    backend = os.environ.get("GPU_RANKS_BACKEND", "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("GPU_RANKS_DEVICE", "cuda") == "cuda":
        device = torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120),
                            device_id=device if backend == "nccl" else None)
    torch.set_num_threads(1)
    return D.Dist(rank, device.index or 0, world, device, backend)


def want(part: str, value):
    """The expected value, made wrong when GPU_RANKS_BREAK names the part."""
    if part not in BREAK:
        return value
    return value + 1 if isinstance(value, int) else -1.0  # counts: off by one; bounds: < 0


def batch(seed: int, device, n: int = 6, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 8, generator=g).add_(shift).to(device),
            torch.randn(n, 4, generator=g).to(device))


def mlp(device, scale: float = 1.0) -> nn.Module:
    torch.manual_seed(0)  # the same init on both ranks
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(scale)
    return net.to(device)


def collectives(d: D.Dist) -> str:
    r, dev, done = d.rank, d.device, []
    t = D.all_sum(d, torch.tensor([r + 1.0], device=dev))
    assert t.item() == want("collectives", 3.0), t
    done.append("all_reduce(sum)")
    assert D.all_min(d, 5 + r) == 5
    done.append("all_reduce(min)")
    assert D.all_gather_floats(d, [r, 2.0 * r]) == [[0.0, 0.0], [1.0, 2.0]]
    done.append("all_gather")
    assert D.gather_objects(d, {"r": r}) == [{"r": 0}, {"r": 1}]
    done.append("all_gather_object")
    assert D.broadcast_object(d, {"from": r}) == {"from": 0}
    done.append("broadcast_object_list")
    bn = nn.BatchNorm1d(3).to(dev)
    bn.running_mean.fill_(7.0 + r)
    D.broadcast_buffers(d, bn)
    assert torch.equal(bn.running_mean, torch.full((3,), 7.0, device=dev))
    done.append("broadcast")
    c = torch.full((2, 2), r + 1, dtype=torch.int64, device=dev)
    dist.reduce(c, dst=0)  # evaluate.combine's tallies
    assert not d.is_master or torch.equal(c, torch.full_like(c, 3)), c
    done.append("reduce")
    held = [None] * d.world if d.is_master else None
    dist.gather_object((r, [f"skip{r}"]), held, dst=0)
    assert not d.is_master or held == [(0, ["skip0"]), (1, ["skip1"])], held
    done.append("gather_object")
    group, _ = dist.new_subgroups(group_size=d.world)  # the node groups of data.resident
    s = torch.tensor([r + 1.0], device=dev)
    dist.all_reduce(s, group=group)
    assert s.item() == 3.0
    done.append("new_subgroups+all_reduce")
    return f"{len(done)} exact: {', '.join(done)}"


def _reference_grads(net: nn.Module, micro_batches, divide: float) -> list[torch.Tensor]:
    """Gradients a plain model sums over `micro_batches` (each loss / divide)."""
    net.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        (F.mse_loss(net(x), y) / divide).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def ddp_no_sync(d: D.Dist) -> str:
    net = mlp(d.device)
    plain = copy.deepcopy(net)
    ddp = D.wrap(net, d, "ddp", sync_bn=False)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel), type(ddp)
    data = {(r, m): batch(10 * r + m, d.device) for r in range(2) for m in range(2)}
    own = _reference_grads(plain, [data[d.rank, 0]], 2)
    for m in range(2):
        with ddp.no_sync() if m == 0 else contextlib.nullcontext():
            x, y = data[d.rank, m]
            (F.mse_loss(ddp(x), y) / 2).backward()
        if m == 0:  # no_sync: this rank's own gradient, nothing all-reduced
            local = _max_diff([p.grad for p in net.parameters()], own)
            assert local < 1e-6, f"after the no_sync micro-batch: {local:.2e} from own"
    per_rank = [_reference_grads(plain, [data[r, 0], data[r, 1]], 2) for r in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*per_rank)]
    diff = _max_diff([p.grad for p in net.parameters()], mean)
    other = _max_diff(per_rank[0], per_rank[1])
    assert other > 1e-3, "the ranks' batches give the same gradient: nothing shown"
    assert diff < want("ddp_no_sync", 1e-5), f"{diff:.2e} from the mean over ranks"
    return f"max |grad - mean over ranks| {diff:.1e} (ranks differ by {other:.1e})"


def grad_hook(d: D.Dist) -> str:
    net = mlp(d.device)
    plain = copy.deepcopy(net)
    ddp = D.wrap_ddp(net, d)
    ddp.register_comm_hook(None, D.ordered_mean_hook)
    x, y = batch(20 + d.rank, d.device)
    F.mse_loss(ddp(x), y).backward()
    per_rank = [_reference_grads(plain, [batch(20 + r, d.device)], 1) for r in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*per_rank)]
    diff = _max_diff([p.grad for p in net.parameters()], mean)
    assert diff < want("grad_hook", 1e-5), f"{diff:.2e} from the mean over ranks"
    return f"ordered_mean_hook: max |grad - mean| {diff:.1e}"


PLANTED = (2, 5)  # steps whose rank-1 no_sync micro-batch gets an inf gradient
STEPS = 8


def fp16_skipped(d: D.Dist) -> str:
    net = mlp(d.device, scale=0.1)
    ddp = D.wrap(net, d, "ddp", sync_bn=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(d.device.type, init_scale=2.0 ** 8)
    counters = SimpleNamespace(skipped=torch.tensor(0, device=d.device),
                               step_dev=torch.tensor(1, device=d.device))
    amp = torch.float16 if d.device.type == "cuda" else torch.bfloat16
    untouched = []
    for step in range(STEPS):
        before = [p.detach().clone() for p in net.parameters()]
        for m in range(2):
            with ddp.no_sync() if m == 0 else contextlib.nullcontext():
                x, y = batch(100 * step + 10 * d.rank + m, d.device)
                with torch.autocast(d.device.type, dtype=amp):
                    loss = F.mse_loss(ddp(x).float(), y) / 2
                scaler.scale(loss).backward()
            if m == 0 and d.rank == 1 and step in PLANTED:
                next(net.parameters()).grad.view(-1)[0] = float("inf")
        update(ddp, opt, sched, scaler, 1.0, counters)
        if all(torch.equal(a, b) for a, b in zip(before, net.parameters())):
            untouched.append(step)
    skipped = int(counters.skipped.item())
    sums = D.all_gather_floats(d, [float(sum(p.detach().double().sum() for p in net.parameters()))])
    assert skipped == want("fp16_skipped", len(PLANTED)), f"skipped {skipped}, planted 2"
    assert untouched == list(PLANTED), f"steps that left the weights: {untouched}"
    assert sums[0] == sums[1], f"the ranks' weights differ: {sums}"
    assert scaler.get_scale() == 2.0 ** 8 / 2 ** len(PLANTED), scaler.get_scale()
    return (f"skipped {skipped} of {STEPS} steps (planted at steps {list(PLANTED)}, rank 1 "
            f"only), scale {scaler.get_scale():g}, {amp}".replace("torch.", ""))


def syncbn(d: D.Dist) -> str:
    if d.device.type != "cuda":
        raise Skip("SyncBatchNorm runs on CUDA tensors only")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).to(d.device)
    plain = copy.deepcopy(net)
    model = D.wrap(net, d, "ddp", sync_bn=True)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    xs = [torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(r)).add_(3.0 * r)
          .to(d.device) for r in range(2)]
    out = model(xs[d.rank])
    ref = plain(torch.cat(xs))  # one BatchNorm over both ranks' samples
    bn = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)][0]
    mean_diff = (bn.running_mean - plain[1].running_mean).abs().max().item()
    var_diff = (bn.running_var - plain[1].running_var).abs().max().item()
    out_diff = (out - ref[4 * d.rank:4 * d.rank + 4]).abs().max().item()
    assert max(mean_diff, var_diff, out_diff) < want("syncbn", 1e-4), (
        mean_diff, var_diff, out_diff)
    return f"running stats and outputs as one BatchNorm: max |diff| {max(mean_diff, out_diff):.1e}"


def compile_ddp(d: D.Dist) -> str:
    if d.device.type != "cuda" and os.environ.get("GPU_RANKS_COMPILE") != "1":
        raise Skip("compile on the CPU: minutes of C++ builds (GPU_RANKS_COMPILE=1 runs it)")
    from torch._dynamo.utils import counters

    eager_net = mlp(d.device)
    net = copy.deepcopy(eager_net)
    eager = D.wrap_ddp(eager_net, d)
    compiled = torch.compile(D.wrap_ddp(net, d))
    x, y = batch(30 + d.rank, d.device)
    F.mse_loss(eager(x), y).backward()
    F.mse_loss(compiled(x), y).backward()
    graphs = counters["stats"]["unique_graphs"]
    diff = _max_diff([p.grad for p in net.parameters()], [p.grad for p in eager_net.parameters()])
    assert graphs >= want("compile_ddp", 1) and diff < 1e-4, (graphs, diff)
    return f"{graphs} graph(s); max |grad - eager DDP's| {diff:.1e}"


PARTS = (collectives, ddp_no_sync, grad_hook, fp16_skipped, syncbn, compile_ddp)


def main() -> None:
    d = setup()
    where = f"{d.backend} on {d.device.type}"
    for part in PARTS:
        try:
            status, what = "PASS", f"{part(d)} ({where})"
        except Skip as e:
            status, what = "SKIP", f"{e} ({where})"
        except Exception as e:  # noqa: BLE001 - reported as this part's FAIL
            traceback.print_exc()
            status, what = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        both = D.gather_objects(d, (status, what))
        if d.is_master:
            bad = [f"rank {r}: {w}" for r, (s, w) in enumerate(both) if s == "FAIL"]
            status = "FAIL" if bad else both[0][0]
            print(f"RESULT {part.__name__} {status} {'; '.join(bad) or both[0][1]}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
