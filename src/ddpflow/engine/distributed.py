"""Process-group setup for one rank under torchrun: device, backend, seeds, determinism."""

from __future__ import annotations

import datetime
import inspect
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as torch_dist

from ddpflow.config.types import HardwareCfg
from ddpflow.core.errors import UserError
from ddpflow.core.seeds import seed_sequence


@dataclass
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device
    backend: str | None  # None: a single process without a process group (strategy dp)

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def pick_device(hw: HardwareCfg) -> torch.device:
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise UserError("hardware.device is 'cuda' but no CUDA GPU is visible; "
                        "use hardware.device: cpu (or auto)")
    use_cuda = hw.device == "cuda" or (hw.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def setup(hw: HardwareCfg, process_group: bool | str = True) -> Dist:
    """Read torchrun's environment, bind this rank to its GPU, join the process group
    (process_group "always": one of a single rank too, outside torchrun)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(hw)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                            f"lower hardware.nproc_per_node")
        torch.cuda.set_device(local_rank)  # one rank per GPU: LOCAL_RANK -> cuda:LOCAL_RANK
        device = torch.device("cuda", local_rank)
    cores = len(os.sched_getaffinity(0))  # a slot of a shared node narrows these
    threads = int(os.environ.get("DDPFLOW_THREADS", 0)) or max(1, cores // world)
    torch.set_num_threads(threads)
    backend = None
    if process_group and ("RANK" in os.environ or process_group == "always"):
        backend = "nccl" if device.type == "cuda" else "gloo"
        # without torchrun (a lone process that still needs a group: FSDP), a group of one
        alone = {} if "RANK" in os.environ else {"store": torch_dist.HashStore(), "rank": 0,
                                                 "world_size": 1}
        # a hung collective fails after timeout_s instead of holding the allocation for hours
        torch_dist.init_process_group(backend, timeout=datetime.timedelta(seconds=hw.timeout_s),
                                device_id=device if device.type == "cuda" else None, **alone)
    return Dist(rank, local_rank, world if backend else 1, device, backend)


def teardown(dist: Dist) -> None:
    if dist.backend and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def seed_everything(seed: int, rank: int, deterministic: bool) -> None:
    """Same model init on every rank: torch's generator takes `seed` itself here, and
    `seed_rank_stream` gives each rank its own once the model is built. Python's and
    numpy's generators are per rank from the start."""
    random.seed(seed_sequence(seed, rank))
    np.random.seed(seed_sequence(seed, rank) % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # pick the fastest conv kernels for fixed shapes


def seed_rank_stream(seed: int, rank: int) -> None:
    """After the model is built (the same init on every rank): each rank's own torch stream
    (CPU and every GPU), so dropout and drop-path masks differ across ranks and repeat on a
    rerun with the same seed and rank."""
    torch.manual_seed(seed_sequence(seed, rank))


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_objects(dist: Dist, obj) -> list:
    """Every rank's obj on every rank (a collective; a sync point)."""
    if not dist.backend:
        return [obj]
    out = [None] * dist.world
    torch_dist.all_gather_object(out, obj)
    return out


def all_sum(dist: Dist, t: torch.Tensor) -> torch.Tensor:
    if dist.backend:
        torch_dist.all_reduce(t)
    return t


def all_min(dist: Dist, value: int, op: str = "MIN") -> int:
    """The least (op MAX: the largest) of every rank's `value` (a collective)."""
    if not dist.backend:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=dist.device)
    torch_dist.all_reduce(t, op=getattr(torch_dist.ReduceOp, op))
    return int(t.item())


def all_gather_floats(dist: Dist, values: list[float]) -> list[list[float]]:
    """Per-rank lists of floats (a collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=dist.device)
    if not dist.backend:
        return [t.tolist()]
    out = [torch.zeros_like(t) for _ in range(dist.world)]
    torch_dist.all_gather(out, t)
    return [o.tolist() for o in out]


def broadcast_buffers(dist: Dist, module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running stats) to every rank. DDP does this at the start
    of each forward, so after the last training step they differ until this runs."""
    if dist.backend:
        for b in module.buffers():
            torch_dist.broadcast(b, src=0)


def broadcast_object(dist: Dist, obj):
    """Rank 0's obj on every rank (a collective)."""
    if not dist.backend:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


# the keyword changed name (broadcast_buffers is deprecated from torch 2.13 on); both still
# sync the buffers once, when DDP is built
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                           inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})


def wrap_ddp(model: torch.nn.Module, dist: Dist, deterministic: bool = False
             ) -> torch.nn.Module:
    """DistributedDataParallel when more than one rank trains (one rank has nothing to
    all-reduce, so it pays no DDP overhead); gradients live in DDP's buckets (no copy per
    step). Buffers are not broadcast at every forward (a collective per step): BatchNorm
    trains on each batch's own statistics, not on the running ones, and validation, the
    test split and the final weights take rank 0's (broadcast_buffers below).
    deterministic with more than two ranks: the gradients are summed in rank order
    (ordered_mean_hook), so a resumed run repeats an uninterrupted one bit for bit."""
    if not dist.backend or dist.world == 1:
        return model
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
        gradient_as_bucket_view=True, **_NO_FORWARD_BUFFER_SYNC)
    if deterministic and dist.world > 2:
        ddp.register_comm_hook(None, ordered_mean_hook)
    return ddp


def ordered_mean_hook(_state, bucket):
    """A DDP communication hook whose result does not depend on the bucket layout.

    A ring all-reduce sums each element in an order set by where the element falls in its
    bucket, and DDP lays out its buckets anew in the first step of every process (one bucket
    first, then the order the gradients became ready): so the first step after a resume sums
    some elements in another order than the uninterrupted run did at that step. Two ranks'
    sum is the same in either order; from three on it is not. Here every rank gathers all
    ranks' buckets and sums them in rank order: world x the traffic, for deterministic mode.
    """
    world = torch_dist.get_world_size()
    grads = bucket.buffer()
    parts = [torch.empty_like(grads) for _ in range(world)]
    fut = torch_dist.all_gather(parts, grads, async_op=True).get_future()

    def mean(f):
        got = f.value()
        gathered = got[0] if isinstance(got[0], list) else got
        out = gathered[0].clone()
        for part in gathered[1:]:  # rank order, element by element
            out.add_(part)
        return grads.copy_(out.div_(world))
    return fut.then(mean)


def wrap(model: torch.nn.Module, dist: Dist, strategy: str, sync_bn: bool,
         deterministic: bool = False) -> torch.nn.Module:
    """The training wrapper: DDP (when more than one rank trains), optionally with
    SyncBatchNorm; strategy dp = single-process DataParallel, a baseline only (without
    GPUs it calls the module as it is)."""
    if dist.backend and sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if strategy == "dp":
        return torch.nn.DataParallel(model)
    return wrap_ddp(model, dist, deterministic)
