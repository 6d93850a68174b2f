"""The Lightning side of bench/vs_lightning.py: a plain Lightning 2.x script as users write it
(ImageFolder + per-sample transforms + DataLoader workers, a LightningModule, Trainer with
DDP on the CPU), training ResNet-18 for the same epochs, batch, optimizer and schedule as the
ddpflow side. Runs in the benchmark's own environment (Lightning is not a ddpflow
dependency). Prints one JSON line: steady-state samples/s measured like ddpflow's (between
consecutive training batches of an epoch, the first log interval of the run left out)."""

from __future__ import annotations

import json
import sys
import time

import lightning as L
import torch
import torchvision
import torchvision.transforms as T
from torch import nn

root, epochs, batch, lr, workers, skip = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))


class Timer(L.Callback):
    """Times every training batch on rank 0; an epoch's first batch and the run's first
    `skip` batches are left out (warm-up and the gap after validation)."""

    def __init__(self):
        self.last, self.dts, self.seen = None, [], 0

    def on_train_epoch_start(self, trainer, module):
        self.last = None

    def on_train_batch_end(self, trainer, module, outputs, b, i):
        now = time.perf_counter()
        self.seen += 1
        if self.last is not None and self.seen > skip:
            self.dts.append(now - self.last)
        self.last = now


class Net(L.LightningModule):
    def __init__(self, steps: int):
        super().__init__()
        self.net = torchvision.models.resnet18(num_classes=10)
        self.loss = nn.CrossEntropyLoss()
        self.steps = steps

    def training_step(self, b, i):
        x, y = b
        loss = self.loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, b, i):
        x, y = b
        out = self.net(x)
        self.log("val_loss", self.loss(out, y), sync_dist=True)
        self.log("val_acc", (out.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9, nesterov=True,
                              weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    torch.set_num_threads(1)  # one core per rank, as torchrun (and ddpflow) set it
    norm = T.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    train = torchvision.datasets.ImageFolder(f"{root}/train", T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(f"{root}/val", T.Compose([T.ToTensor(), norm]))
    kw = dict(batch_size=batch, num_workers=workers, persistent_workers=workers > 0)
    train_dl = torch.utils.data.DataLoader(train, shuffle=True, drop_last=True, **kw)
    val_dl = torch.utils.data.DataLoader(val, **kw)
    steps = epochs * (len(train) // (batch * 2))
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                        precision="32-true", callbacks=[timer], logger=False,
                        enable_checkpointing=True, default_root_dir=f"{root}/lightning",
                        enable_progress_bar=True)
    trainer.fit(Net(steps), train_dl, val_dl)
    if trainer.global_rank == 0:
        dts = timer.dts
        print(json.dumps({"samples_per_s": batch * 2 * len(dts) / sum(dts),
                          "val_acc": float(trainer.callback_metrics["val_acc"])}), flush=True)


if __name__ == "__main__":
    main()
