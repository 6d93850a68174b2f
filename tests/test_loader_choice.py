"""data.loader auto (data/loaders.choose_loader): the device loader where the dataset fits in
its share of free device memory, the DataLoader where it does not; a loader the user set is
kept."""

from __future__ import annotations

import torch

from ddpflow.data.loaders import choose_loader

CPU, GiB, MiB = torch.device("cpu"), 2**30, 2**20


def test_the_device_loader_where_the_dataset_fits_in_its_share_of_free_memory():
    assert choose_loader("auto", 4 * GiB, CPU, 0.5, free=8 * GiB) == (
        "device", "dataset 4096 MiB fits in 0.5 of 8.0 GiB free cpu memory")
    kind, reason = choose_loader("auto", 4 * GiB + 1, CPU, 0.5, free=8 * GiB)
    assert kind == "dataloader" and reason == (
        "dataset 4096 MiB does not fit in 0.5 of 8.0 GiB free cpu memory")
    # under a GiB free, the room in MiB; the caller's note (an agreed budget) at the end
    assert choose_loader("auto", 100 * MiB, CPU, 0.9, free=512 * MiB, note=" (agreed)") == (
        "device", "dataset 100 MiB fits in 0.9 of 512 MiB free cpu memory (agreed)")
    assert choose_loader("auto", 1 * GiB, CPU, 1.0, free=1 * GiB)[0] == "device"


def test_a_loader_the_user_set_is_kept_whatever_fits():
    for kind in ("device", "dataloader"):
        assert choose_loader(kind, 100 * GiB, CPU, 0.5, free=MiB) == (
            kind, f"data.loader is set to '{kind}'")
