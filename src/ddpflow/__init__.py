"""ddpflow: DDP + AMP training stages across the GPUs of a node, from one validated config."""

__version__ = "0.1.0"
