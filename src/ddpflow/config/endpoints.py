"""Addresses of the systems outside ddpflow, checked before any job runs: the MLflow tracking
URI, the container image URI that Snakemake's `container:` directive takes, and a Slurm gres
string. Each check returns the problem as one sentence (or None), so config validation can
name the key and what to write instead.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql",
                  "databricks")
GRES_GPU = re.compile(r"^gpu(?::([A-Za-z0-9_.]+))?:([0-9]+)$")


def mlflow_uri_problem(uri: str) -> str | None:
    """MLflow takes a server URL, a database URI, `databricks`, or a local folder."""
    if uri == "databricks" or uri.startswith("databricks://"):
        return None
    u = urlparse(uri)
    if not u.scheme:  # a local folder (MLflow's file store); relative to the working folder
        return None if uri.strip() == uri and uri else "is empty or has surrounding spaces"
    if u.scheme not in MLFLOW_SCHEMES:
        return (f"has scheme '{u.scheme}:', which MLflow does not take; use http://host:port, "
                f"https://host, file:/folder, sqlite:///file.db or databricks")
    if u.scheme in ("http", "https") and not u.hostname:
        return f"has no host; write it as {u.scheme}://host:port"
    try:
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "has a port that is not a number"
    return None


def container_uri_problem(uri: str) -> str | None:
    """What `container:` and `apptainer build` take: docker://, oras:// or a .sif file."""
    if uri.startswith(("docker://", "oras://")):
        rest = uri.split("://", 1)[1]
        if not rest or " " in rest or rest.startswith("/"):
            return "has no image after the scheme, e.g. docker://org/ddpflow:1.0"
        return None
    if uri.endswith(".sif") and "://" not in uri:
        return None
    return ("is not docker://<image>, oras://<image> or a path to a .sif file (a plain "
            "image name needs docker:// in front)")


def gres_gpus(gres: str) -> int | None:
    """GPUs asked for by a gres string, `gpu:2` or `gpu:a100:2` (the forms the Slurm executor
    plugin passes on), or None when it is neither."""
    m = GRES_GPU.match(gres)
    return int(m.group(2)) if m else None
