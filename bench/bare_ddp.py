"""The ceiling of bench/vs_lightning.py: the same ResNet-18 step with nothing around it.

    torchrun --nproc_per_node 2 bench/bare_ddp.py STEPS BATCH LR SKIP

DDP over gloo, one thread per rank, the same optimizer (SGD, nesterov, weight decay) and
batch per rank, fp32 in PyTorch's default layout, on one random batch already in memory:
no data loading, augmentation, logging, validation or checkpoints. No trainer that keeps
this arithmetic can step faster, so it bounds what any trainer can gain over another on
this machine. Prints one JSON line (rank 0): steady-state samples/s over all ranks, measured
like both trainers (between consecutive steps, the first SKIP steps left out).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torchvision

steps, batch, lr, skip = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])


def main() -> None:
    torch.set_num_threads(1)  # one core per rank, as on both sides of the benchmark
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torchvision.models.resnet18(num_classes=10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    loss_fn, dts, last = torch.nn.CrossEntropyLoss(), [], None
    for i in range(steps):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if last is not None and i > skip:
            dts.append(now - last)
        last = now
    if dist.get_rank() == 0:
        print(json.dumps({"samples_per_s": batch * dist.get_world_size() * len(dts) / sum(dts)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
