"""Addresses of the systems outside ddpflow, checked before any job runs: the MLflow tracking
URI (its form, and what the mlflow installed here refuses at once: its folder store from 3.13
on, a database without its driver), the container image URI that Snakemake's `container:`
directive takes, and a Slurm gres string. Each check returns the problem as one sentence (or
None), so config validation can name the key and what to write instead.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql",
                  "databricks")
MLFLOW_FORMS = ("http://host:port, https://host, sqlite:///relative.db, sqlite:////absolute.db, "
                "postgresql://..., mysql://..., mssql://... or databricks")
# MLflow 3.13 made its folder store (a path or file: URI) an error unless this is true
FILE_STORE_REFUSED_FROM = (3, 13)
FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"
# SQLAlchemy's driver module for a database scheme (without +driver: its default), and the
# package that provides it; a driver not listed here is left to SQLAlchemy
DB_DRIVERS = {"postgresql": ("psycopg2", "psycopg2-binary"),
              "postgresql+psycopg2": ("psycopg2", "psycopg2-binary"),
              "postgresql+psycopg": ("psycopg", "psycopg"),
              "postgresql+pg8000": ("pg8000", "pg8000"),
              "mysql": ("MySQLdb", "mysqlclient"), "mysql+mysqldb": ("MySQLdb", "mysqlclient"),
              "mysql+pymysql": ("pymysql", "pymysql"),
              "mssql": ("pyodbc", "pyodbc"), "mssql+pyodbc": ("pyodbc", "pyodbc"),
              "mssql+pymssql": ("pymssql", "pymssql")}
GRES_GPU = re.compile(r"^gpu(?::([A-Za-z0-9_.]+))?:([0-9]+)$")


def mlflow_uri_problem(uri: str) -> str | None:
    """MLflow takes a server URL, a database URI or `databricks`; a local folder only where
    the installed mlflow still writes its folder store (see `mlflow_installed_problem`)."""
    if not uri or uri.strip() != uri or any(ord(c) < 32 for c in uri):
        return "is empty or has surrounding spaces or control characters"
    if uri == "databricks" or uri.startswith("databricks://"):
        return mlflow_installed_problem(uri, "databricks")
    u = urlparse(uri)
    if not u.scheme or u.scheme == "file":  # MLflow's folder store
        if u.scheme and u.netloc not in ("", "localhost"):
            return (f"names the host '{u.netloc}'; a file: URI is a folder on this machine "
                    f"(file:/folder); use {MLFLOW_FORMS}")
        return mlflow_installed_problem(uri, "file")
    base = u.scheme.split("+")[0]
    if base not in MLFLOW_SCHEMES or u.scheme.count("+") > 1 or (
            "+" in u.scheme and base not in ("postgresql", "mysql", "mssql")):
        return f"has scheme '{u.scheme}:', which MLflow does not take; use {MLFLOW_FORMS}"
    if base in ("http", "https") and not u.hostname:
        return f"has no host; write it as {u.scheme}://host:port"
    try:
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "has a port that is not a number"
    if base == "sqlite":
        if not uri.startswith("sqlite:///"):
            return ("is not a form SQLAlchemy reads; write sqlite:///relative/file.db or "
                    "sqlite:////absolute/file.db")
        if uri[len("sqlite:///"):] in ("", ":memory:"):
            return ("is an in-memory database, which keeps nothing once each process ends; "
                    "write sqlite:///relative/file.db or sqlite:////absolute/file.db")
        return None
    return mlflow_installed_problem(uri, u.scheme)


def _installed_mlflow() -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        text = metadata.version("mlflow")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _present(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def mlflow_installed_problem(uri: str, kind: str) -> str | None:
    """What the mlflow installed here refuses at once (no mlflow here: nothing to ask; the
    trackers' check says to install it). A server that is away is not a problem: what it
    misses is kept and resent."""
    import os

    version = _installed_mlflow()
    if version is None:
        return None
    shown = ".".join(map(str, version))
    if kind == "file":
        opt = os.environ.get(FILE_STORE_OPT_IN)
        if opt is not None and opt.lower() not in ("true", "false", "1", "0"):
            return (f"is a folder store and {FILE_STORE_OPT_IN}={opt!r}, which mlflow refuses; "
                    f"set it to true or false")
        if version >= FILE_STORE_REFUSED_FROM and (opt or "").lower() not in ("true", "1"):
            return (f"is a folder (MLflow's file store), which the installed mlflow {shown} "
                    f"refuses to log to; use sqlite:///mlflow.db (one file, made on first "
                    f"use) or a server, i.e. {MLFLOW_FORMS}, or set {FILE_STORE_OPT_IN}=true "
                    f"to keep the folder store")
        return None
    if kind == "databricks":
        if not _present("databricks.sdk"):
            return (f"needs the databricks-sdk package, which the installed mlflow {shown} "
                    f"reads credentials with and is not installed: pip install databricks-sdk")
        return None
    driver = DB_DRIVERS.get(kind)
    if driver and not _present(driver[0]):
        return (f"needs the database driver {driver[0]} (pip install {driver[1]}), which is "
                f"not installed here")
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
