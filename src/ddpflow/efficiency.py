"""How busy the hardware really was: FLOPs per step, MFU, and GPU sampling through NVML.

MFU = achieved FLOP/s / (peak FLOP/s x GPUs). FLOPs are counted once, on the first training
step, with torch.utils.flop_counter (forward + backward, matmuls and convolutions); peaks
are the vendors' dense figures for the precision the stage trains in.
"""

from __future__ import annotations

import threading
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

# dense peak FLOP/s: (bf16/fp16 tensor cores, tf32 tensor cores); matched by name substring
PEAK = [
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),
    ("A100", 312e12, 156e12),
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


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for this precision, or None where unknown (CPUs, new GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half, tf32 in PEAK:
        if key in name:
            return half if precision in ("bf16", "fp16") else tf32
    return None


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


class GpuSampler:
    """Samples GPU utilisation and memory in use every `every` seconds (NVML, a thread).

    Unavailable (no GPU, no nvidia-ml-py) it reports None and costs nothing."""

    def __init__(self, device: torch.device, every: float = 0.5):
        self.samples: list[tuple[float, float]] = []
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            # NVML numbers GPUs physically, torch after CUDA_VISIBLE_DEVICES: match by UUID
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:  # noqa: BLE001
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - sampling is optional
            self.handle = None
            return
        self.lock = threading.Lock()
        self.every = every
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop.is_set():
            try:
                util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
                mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
            except Exception:  # noqa: BLE001
                return
            with self.lock:
                self.samples.append((float(util), float(mem)))
            time.sleep(self.every)

    def interval(self) -> tuple[float | None, float | None]:
        """(mean utilisation %, max memory MiB) since the last call."""
        if self.handle is None:
            return None, None
        with self.lock:
            s, self.samples = self.samples, []
        if not s:
            return None, None
        return sum(u for u, _ in s) / len(s), max(m for _, m in s)

    def close(self):
        if self.handle is not None:
            self.stop.set()
