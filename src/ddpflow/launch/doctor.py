"""`ddpflow doctor`: what this machine offers for training, and what to change.

Works without a GPU (and says so). Reads torch, NVML (nvidia-ml-py, when installed),
/dev/shm and the CPU count; never changes anything.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ddpflow.config import Config


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        return any(k in Path("/proc/1/cgroup").read_text() for k in ("docker", "containerd",
                                                                     "kubepods", "libpod"))
    except OSError:
        return False


def _nvml_processes() -> dict[str, tuple[float, int]]:
    """{GPU UUID: (MiB used by other processes, process count)} where NVML answers. Keyed
    by UUID: NVML numbers GPUs physically, torch after CUDA_VISIBLE_DEVICES."""
    try:
        import pynvml

        pynvml.nvmlInit()
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            used = sum((p.usedGpuMemory or 0) for p in procs) / 2**20
            out[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = (used, len(procs))
        return out
    except Exception:  # noqa: BLE001 - NVML is optional
        return {}


def gpu_uuid(index: int) -> str:
    """torch's GPU `index` (after CUDA_VISIBLE_DEVICES) as NVML and Docker name it."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def report(cfg: Config | None = None) -> str:
    lines, advice = [], []
    n = torch.cuda.device_count()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "-"
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    lines.append(f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None
                 else "CUDA_VISIBLE_DEVICES is not set (all GPUs visible)")
    if n == 0:
        lines.append("GPUs: none visible to torch: training runs on the CPU")
        advice.append("no GPU: check `nvidia-smi`, the driver, CUDA_VISIBLE_DEVICES and, in "
                      "a container, --gpus all / CDI / --nv")
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        lines.append(f"NCCL {nccl}; {n} GPU(s):")
        others = _nvml_processes()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            used_by_others, count = others.get(gpu_uuid(i), (None, None))
            line = (f"  [{i}] {p.name}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free, "
                    f"compute {p.major}.{p.minor}, {p.multi_processor_count} SMs")
            if count:
                line += f"; {count} other process(es) use {used_by_others:.0f} MiB"
                advice.append(f"GPU {i} is shared with {count} process(es): pick free GPUs "
                              f"with hardware.devices")
            lines.append(line)
            if p.major < 8:
                advice.append(f"GPU {i} has no bf16: precision auto uses fp16 + GradScaler")
        ids = list(cfg.hardware.devices) if cfg and cfg.hardware.devices else list(range(n))
        ids = [i for i in ids if i < n]
        pairs = [(a, b) for a in ids for b in ids if a < b]
        if pairs:
            no_p2p = [(a, b) for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
            lines.append(f"peer-to-peer between the chosen GPUs: "
                         f"{'all pairs' if not no_p2p else f'missing for {no_p2p}'}")
            if no_p2p:
                advice.append("some GPU pairs lack P2P (no NVLink/PCIe peer access): "
                              "all-reduce goes through host memory; prefer GPUs on one switch")
        try:
            import pynvml

            pynvml.nvmlInit()
            lines.append(f"driver {pynvml.nvmlSystemGetDriverVersion()}")
        except Exception:  # noqa: BLE001
            lines.append("driver: unknown (install nvidia-ml-py for NVML readings)")
    cores = os.cpu_count() or 1
    lines.append(f"CPU cores: {cores}")
    if n and cores < 4 * n:
        advice.append(f"{cores} cores for {n} GPUs: keep data.loader: device (no workers)")
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
    inside = _in_container()
    lines.append(f"/dev/shm: {shm / 2**30:.1f} GiB{' (inside a container)' if inside else ''}")
    if shm < 2**30:
        advice.append("/dev/shm is under 1 GiB: DataLoader workers and NCCL will fail; run the "
                      "container with --ipc=host or --shm-size=16g (container.shm_size)")
    if cfg:
        lines.append(f"config: {cfg.hardware.nproc_per_node} rank(s) per node, devices "
                     f"{cfg.hardware.devices}, loader {cfg.data.loader}, engine "
                     f"{cfg.container.engine}")
        if cfg.hardware.devices and any(i >= n for i in cfg.hardware.devices):
            advice.append(f"hardware.devices {list(cfg.hardware.devices)} names GPUs that do "
                          f"not exist here ({n} visible)")
    if not advice:
        advice.append("nothing to change")
    return "\n".join(lines + ["recommendations:"] + [f"  - {a}" for a in advice])
