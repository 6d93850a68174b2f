"""Addresses of the systems outside ddpflow, checked before any job runs: the MLflow tracking
URI (its form, and what the mlflow installed here refuses at once: its folder store from 3.13
on, a database without its driver), the container image URI that Snakemake's `container:`
directive takes, and a Slurm gres string. Each check returns the problem as one sentence (or
None), so config validation can name the key and what to write instead.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

from ddpflow.config.sbatchopts import extra_problem
from ddpflow.core.errors import short

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


# an image reference as docker, podman and apptainer take it: [host[:port]/]name[:tag][@digest],
# name = lowercase path components (distribution's reference grammar)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*(?::[0-9]+)?/)?"
IMAGE_REF = re.compile(rf"^{_HOST}{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]"
                       rf"{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?$")
IMAGE_FORM = ("[registry/]name[:tag] with a lowercase name and a tag of letters, digits, "
              "'_', '.' and '-' (at most 128), e.g. ddpflow:latest or "
              "localhost:5000/org/ddpflow:1.0")


def image_ref_problem(ref: str) -> str | None:
    """An image name and tag the engines accept, or what is wrong with it."""
    if len(ref) > 255 or not IMAGE_REF.fullmatch(ref):
        return f"is not an image reference: write {IMAGE_FORM}"
    return None


def container_uri_problem(uri: str) -> str | None:
    """What `container:` and `apptainer build` take: docker://, oras:// or a .sif file."""
    if uri.startswith(("docker://", "oras://")):
        rest = uri.split("://", 1)[1]
        if rest.strip() != rest:
            return "has spaces or a line break around the image: remove them"
        if not rest or rest.startswith("/"):
            return "has no image after the scheme, e.g. docker://org/ddpflow:1.0"
        if image_ref_problem(rest):
            return (f"has {short(rest, 60)} after the scheme, which is not an image: write "
                    f"{IMAGE_FORM}")
        return None
    if uri.endswith(".sif") and "://" not in uri and not any(ord(c) < 32 for c in uri):
        return None
    return ("is not docker://<image>, oras://<image> or a path to a .sif file (a plain "
            "image name needs docker:// in front)")


def gres_gpus(gres: str) -> int | None:
    """GPUs asked for by a gres string, `gpu:2` or `gpu:a100:2` (the forms the Slurm executor
    plugin passes on), or None when it is neither."""
    m = GRES_GPU.fullmatch(gres)
    return int(m.group(2)) if m else None


# sbatch values. The Slurm executor plugin quotes partition and account itself but pastes
# slurm_extra into its sbatch line (run by a shell) as written: slurm.extra is taken only as
# words of these characters (no quote, $, backtick, ;, |, &, <, >, (, ), \ or newline can
# reach that shell), and ddpflow quotes each word again when it builds slurm_extra.
SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SLURM_PARTITIONS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(,[A-Za-z0-9][A-Za-z0-9_.-]*)*$")
SLURM_GPU_MODEL = re.compile(r"^[A-Za-z0-9_.]+$")  # what the executor plugin accepts
SLURM_EXTRA_WORD = re.compile(r"^[A-Za-z0-9_=:,./@%+-]+$")
def slurm_extra_problem(extra: str) -> str | None:
    """slurm.extra: sbatch options as plain words the executor's shell line keeps as they
    are, each one sbatch takes and a user may add (none that the executor or ddpflow sets
    from another key, nor one that changes what the job is)."""
    for word in extra.split():
        if not SLURM_EXTRA_WORD.fullmatch(word):
            bad = sorted({c for c in word if not SLURM_EXTRA_WORD.fullmatch(c)})
            shown = ", ".join(repr(c) for c in bad[:5])
            return (f"has {shown} in {short(word, 60)}: the Slurm executor pastes slurm.extra "
                    f"into a shell line unquoted, so ddpflow takes only sbatch options made "
                    f"of letters, digits and _ = : , . / @ % + - separated by spaces (no "
                    f"quotes needed, e.g. --gpus-per-node=8 --mail-type=END)")
    # the options as sbatch reads them (prefixes, short forms, values): only those a user
    # may add pass (sbatchopts.py)
    return extra_problem(extra)


def slurm_problem(s: dict) -> tuple[str, str] | None:
    """(key, problem) of the first slurm: value that cannot reach sbatch as meant, or None.
    Ranges the schema holds (0, absurd sizes) are checked there."""
    for key, form, example in (("partition", SLURM_PARTITIONS, "gpu or gpu,long"),
                               ("account", SLURM_NAME, "proj-123"),
                               ("gpu_model", SLURM_GPU_MODEL, "a100")):
        value = s.get(key)
        if value is not None and not form.fullmatch(value):
            return key, (f"{short(value, 60)} is not a Slurm {key.replace('_', ' ')}: use "
                         f"letters, digits, '_', '.' and '-' (e.g. {example}), no spaces, "
                         f"quotes or ';'")
    if (problem := slurm_extra_problem(s.get("extra") or "")):
        return "extra", problem
    limit = s["runtime_min"] * 60
    if s["signal_before_end_s"] >= limit:
        return "signal_before_end_s", (
            f"is {s['signal_before_end_s']} s but a job runs only {limit} s "
            f"(slurm.runtime_min {s['runtime_min']}): the signal to checkpoint must come "
            f"before the end; set it below {limit} (e.g. {min(180, limit // 2)}) or raise "
            f"runtime_min")
    return None
