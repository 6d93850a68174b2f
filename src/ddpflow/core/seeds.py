"""Seeds derived from a tuple of integers (seed, epoch, step, rank, ...).

A linear formula such as seed * a + step * b + rank collides as soon as one term's range
reaches the next term's factor; numpy's SeedSequence hashes the whole tuple instead, so two
different tuples give unrelated 63-bit seeds (torch.manual_seed and Generator.manual_seed
take them as they are).
"""

from __future__ import annotations


def seed_sequence(*keys: int) -> int:
    """A 63-bit seed for the tuple of integers `keys`, the same on every machine."""
    import numpy as np  # core stays light: numpy only when a seed is derived

    lo, hi = np.random.SeedSequence([int(k) % 2**64 for k in keys]).generate_state(2, np.uint32)
    return ((int(hi) << 32) | int(lo)) & (2**63 - 1)
