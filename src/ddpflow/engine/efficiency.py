"""How busy the hardware really was: FLOPs per step, MFU, and GPU sampling through NVML.

MFU = achieved FLOP/s / (peak FLOP/s x GPUs). FLOPs are counted once, on the first training
step, with torch.utils.flop_counter (forward + backward, matmuls and convolutions); peaks
are the vendors' dense figures for the precision the stage trains in.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
from torch.utils.flop_counter import FlopCounterMode

# dense peak FLOP/s: (bf16/fp16 tensor cores, tf32 tensor cores). A key matches when each of
# its words is a whole word of the device name ("NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB"),
# and the key with the most words wins: "H100 NVL" before "H100", and "RTX A1000" is not an
# "A100". Unknown names get None (no MFU) rather than a neighbour's figure.
PEAK = [
    ("H200 NVL", 835e12, 418e12),
    ("H200", 989e12, 494e12),
    ("GH200", 989e12, 494e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90e12),
    ("L4", 121e12, 60e12),
    ("A10", 125e12, 62e12),
    ("RTX 4090", 165e12, 83e12),
    ("RTX 3090", 71e12, 36e12),
    ("RTX A6000", 155e12, 77e12),
    ("V100", 125e12, 15.7e12),  # no bf16: the fp16 tensor-core figure; fp32 has no TF32
    ("T4", 65e12, 8.1e12),
]


def peak_for_name(name: str, precision: str) -> float | None:
    """The dense peak of the GPU called `name` for this precision, or None where unknown."""
    words = set(re.split(r"[\s_-]+", name.upper()))
    hits = [(len(key.split()), half, tf32) for key, half, tf32 in PEAK
            if all(w in words for w in key.upper().split())]
    if not hits:
        return None
    _, half, tf32 = max(hits, key=lambda h: h[0])
    return half if precision in ("bf16", "fp16") else tf32


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for this precision, or None where unknown (CPUs, new GPUs)."""
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device), precision)


class FlopCount:
    """Counts the FLOPs of what runs inside `with counter:` (used for one training step)."""

    def __init__(self):
        self.mode = FlopCounterMode(display=False)
        self.total: int | None = None

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.total = int(self.mode.get_total_flops())
        return False


def replicas(model: torch.nn.Module) -> int:
    """How many GPUs DataParallel splits each batch over (1: it calls the module itself)."""
    if isinstance(model, torch.nn.DataParallel) and model.device_ids:
        return len(model.device_ids)
    return 1


def _head(x, n: int):
    """The first n samples of a batch (tensors, and tuples/lists/dicts of them)."""
    if torch.is_tensor(x):
        return x[:n] if x.dim() > 0 else x
    if isinstance(x, dict):
        return {k: _head(v, n) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_head(v, n) for v in x)
    return x


@contextmanager
def untouched(module: torch.nn.Module):
    """A pass of `module` that leaves no trace: its buffers (BatchNorm statistics), the
    random streams and the gradients are as they were before it."""
    saved = [b.detach().clone() for b in module.buffers()]
    cuda = [p.device for p in module.parameters() if p.is_cuda][:1]
    with torch.random.fork_rng(devices=cuda):
        yield
    with torch.no_grad():
        for b, old in zip(module.buffers(), saved):
            b.copy_(old)
    module.zero_grad(set_to_none=True)


def replica_flops(module: torch.nn.Module, batch, batch_size: int, n_replicas: int,
                  step) -> int:
    """FLOPs of one micro-batch that DataParallel spreads over `n_replicas` GPUs.

    Its replicas run in threads, and a FlopCounterMode is thread-local: counted around
    DataParallel it sees none of their work. So one replica's share runs eagerly on the plain
    module (`step(module, part)`: forward, loss, backward) and the count is scaled to the
    batch, leaving no trace (`untouched`)."""
    n = -(-batch_size // n_replicas)
    with untouched(module), FlopCount() as counter:
        step(module, _head(batch, n))
    return counter.total * batch_size // n


class GpuSampler:
    """Samples GPU utilisation and memory in use every `every` seconds (NVML, a thread), on
    every GPU this process drives (DataParallel drives several).

    Unavailable (no GPU, no nvidia-ml-py) it reports None and costs nothing."""

    def __init__(self, devices: list[torch.device], every: float = 0.5):
        self.samples: list[tuple[float, float]] = []
        self.handles: list = []
        if not devices or devices[0].type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            # NVML numbers GPUs physically, torch after CUDA_VISIBLE_DEVICES: match by UUID
            for device in devices:
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                self.handles.append(pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - sampling is optional
            self.handles = []
            return
        self.lock = threading.Lock()
        self.every = every
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop.is_set():
            try:
                # one sample: the mean utilisation over the GPUs, the fullest GPU's memory
                util = [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
                mem = [self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20 for h in self.handles]
            except Exception:  # noqa: BLE001
                return
            with self.lock:
                self.samples.append((sum(util) / len(util), float(max(mem))))
            time.sleep(self.every)

    def interval(self) -> tuple[float | None, float | None]:
        """(mean utilisation %, max memory MiB of one GPU) since the last call."""
        if not self.handles:
            return None, None
        with self.lock:
            s, self.samples = self.samples, []
        if not s:
            return None, None
        return sum(u for u, _ in s) / len(s), max(m for _, m in s)

    def close(self):
        if self.handles:
            self.stop.set()


class FirstSteps:
    """The trainer's first-step hook: what the first micro-batches measure besides training,
    so that the step itself carries no instrumentation.

    The first micro-batch (again after a change of image size: `recount`) runs under the
    FLOP counter, on the uncompiled model (Dynamo does not compile a frame while a dispatch
    mode is active), with the task's loss checked once; DataParallel's replicas are counted
    apart (their threads escape the counter). The next one runs under the activation meter
    (memory.py: what a micro-batch keeps for the backward). From then on a micro-batch
    is `micro(train_model, batch)` alone. Neither measurement changes what is computed."""

    def __init__(self, model, train_model, checkpointed: list, batch_size: int, micro):
        self.model, self.train_model = model, train_model
        self.checkpointed, self.batch_size = checkpointed, batch_size
        self.micro = micro  # micro(net, batch, check: bool) -> the micro-batch's loss
        self.flops: int | None = None  # FLOPs of one micro-batch, forward + backward
        self.activations: dict | None = None  # what one micro-batch keeps (memory.py)

    def recount(self) -> None:
        self.flops = None

    def __call__(self, batch):
        from ddpflow.engine.memory import activation_meter
        from ddpflow.seams.models import unwrap

        if self.flops is None:
            n = replicas(self.model)
            if n > 1:  # DataParallel's threads: counted apart
                self.flops = replica_flops(unwrap(self.model), batch, self.batch_size, n,
                                           lambda net, part: self.micro(net, part, False))
            with FlopCount() if self.flops is None else nullcontext() as counter:
                loss = self.micro(self.model, batch, True)
            self.flops = self.flops if counter is None else counter.total
            return loss
        if self.activations is None:
            with activation_meter(self.checkpointed) as measured:
                loss = self.micro(self.train_model, batch, False)
            self.activations = measured
            return loss
        return self.micro(self.train_model, batch, False)
