"""Datasets: sources turned into one prepared on-disk format, and the loaders that read it."""
