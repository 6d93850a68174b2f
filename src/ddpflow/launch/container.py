"""Container engines: build the image and run a stage inside it.

docker and podman are driven through the Docker Engine API with the `docker` Python
SDK (podman answers the same API on its socket: `podman system service`). apptainer
has no such API: its image is converted from the built one with `apptainer build` and
stages run with `apptainer exec --nv` (written and documented; not run on our CI).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import shell_word
from ddpflow.core.writing import move_into_place, write_json_atomic
from ddpflow.results.provenance import git_revision

IN_CONTAINER = "DDPFLOW_IN_CONTAINER"
PODMAN_SOCKETS = ("/run/podman/podman.sock",)


DOCKER_SOCKET = "unix:///var/run/docker.sock"  # the Docker SDK's default without DOCKER_HOST
START = {"docker": "start it with `dockerd &` (or `systemctl start docker`)",
         "podman": "start its API with `podman system service --time=0 &`"}
INSTALL = {"docker": "install it (apt-get install docker.io)",
           "podman": "install it (apt-get install podman)"}


def _sockets(engine: str) -> list[str]:
    """The engine addresses to try, in order: DOCKER_HOST when set, else the engine's own."""
    if os.environ.get("DOCKER_HOST"):
        return [os.environ["DOCKER_HOST"]]
    if engine == "docker":
        return [DOCKER_SOCKET]
    run_dir = os.environ.get("XDG_RUNTIME_DIR", "")
    socks = [f"{run_dir}/podman/podman.sock"] if run_dir else []
    return [f"unix://{s}" for s in (*socks, *PODMAN_SOCKETS)]


def _unreachable(engine: str, tried: list[str], error: Exception | None) -> UserError:
    """One message: the engine, the addresses tried and why, and what to do."""
    where = " or ".join(tried)
    path = tried[0][len("unix://"):] if tried[0].startswith("unix://") else None
    if path and len(tried) == 1 and not os.path.exists(path):
        why = "the socket does not exist"
    elif error is None:
        why = "none of these sockets exists"
    else:
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    source = " (from DOCKER_HOST)" if os.environ.get("DOCKER_HOST") else ""
    todo = START[engine] if shutil.which(engine) else INSTALL[engine] + ", then " + START[engine]
    return UserError(f"container.engine is '{engine}', but the {engine} engine at {where}"
                     f"{source} does not answer: {why}; {todo}, or set container.engine: none "
                     f"to run the stages in the host environment")


def client(engine: str):
    """A Docker-API client for docker or podman, or a UserError that names the engine, the
    socket it tried and what to do (never a Docker SDK traceback)."""
    import docker

    tried = _sockets(engine)
    url = tried[0]
    podman_here = engine == "podman" and not os.environ.get("DOCKER_HOST")
    if podman_here:
        found = [s for s in tried if os.path.exists(s[len("unix://"):])]
        if not found:
            raise _unreachable(engine, tried, None)
        url = found[0]
    try:  # from_env: DOCKER_HOST with DOCKER_TLS_VERIFY and DOCKER_CERT_PATH
        c = docker.DockerClient(base_url=url) if podman_here else docker.from_env()
        c.ping()
        return c
    except Exception as e:  # noqa: BLE001 - any failure to reach the engine gets one message
        raise _unreachable(engine, [url], e) from None


# image.json as the stage launcher reads it (core/reading.py validates it first)
IMAGE_SCHEMA = {"type": "object", "properties": {"image_id": {"type": ["string", "null"]}}}


def torch_version() -> str | None:
    """torch.__version__ (with its build tag, 2.14.1+cu130) read from torch/version.py: this
    rule is on every run's critical path, and importing torch for it costs 1.5 s."""
    import importlib.metadata
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    text = (Path(spec.origin).parent / "version.py")
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text.read_text(), re.M) \
        if text.is_file() else None
    return found.group(1) if found else importlib.metadata.version("torch")


def build(cfg: Config, context: Path, out: Path) -> dict:
    """Build the image from <context>/Dockerfile; write image.json; return its record."""
    from ddpflow import __version__

    engine = cfg.container.engine
    record = {"engine": engine, "tag": cfg.container.image, "package_version": __version__}
    if engine == "none":
        record.update(image_id=None, note="stages run in the host environment",
                      python=platform.python_version(), torch=torch_version())
        write_json_atomic(out, record)
        return record
    if engine == "apptainer":
        return _build_apptainer(cfg, context, out, record)
    c = client(engine)
    revision = git_revision(context)
    # a base whose torch has no CUDA would train on the CPU of a GPU node: the build fails
    # there (the Dockerfile checks); a host without GPUs may build a CPU image
    args = {"VERSION": __version__, "REVISION": revision,
            "REQUIRE_CUDA": "1" if _gpu_ids() else "0"}
    if cfg.container.base_image:
        args["BASE_IMAGE"] = cfg.container.base_image
    t0 = time.perf_counter()
    image_id = None
    # the low-level API streams the build log as it happens (progress on long builds)
    for chunk in c.api.build(path=str(context), dockerfile="Dockerfile", tag=cfg.container.image,
                             buildargs=args, network_mode="host", rm=True, decode=True):
        if "stream" in chunk:
            sys.stdout.write(chunk["stream"])
        if "error" in chunk:
            raise UserError(f"image build failed: {chunk['error'].strip()}")
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
    image = c.images.get(image_id or cfg.container.image)
    version = c.version()
    record.update(
        image_id=image.id, revision=revision, build_args=args,
        labels=image.labels, size_bytes=image.attrs.get("Size"),
        engine_version=version.get("Version"), engine_api=version.get("ApiVersion"),
        build_time_s=round(time.perf_counter() - t0, 2),
        digest=(image.attrs.get("RepoDigests") or [None])[0])
    write_json_atomic(out, record)
    return record


def _build_apptainer(cfg: Config, context: Path, out: Path, record: dict) -> dict:
    """The stages' .sif (`<run>/image.sif`): pulled from container.uri by apptainer itself
    (docker:// or oras://, no Docker needed, as on most HPC systems), copied from a .sif
    given as the uri, or, without a uri, built with docker and converted."""
    if shutil.which("apptainer") is None:
        raise UserError("container.engine is 'apptainer', but apptainer is not installed; "
                        "install it, or set container.engine: none")
    sif, uri = out.with_suffix(".sif"), cfg.container.uri
    if uri and "://" not in uri:  # a .sif file (checked by config validation)
        reading.existing(uri, "container.uri", f"build it with `apptainer build "
                         f"{shell_word(uri)} docker://<image>` or give a docker:// uri")
        shutil.copyfile(uri, sif.with_suffix(".sif.tmp"))
    elif uri:
        subprocess.run(["apptainer", "build", "--force", str(sif.with_suffix(".sif.tmp")), uri],
                       check=True)
    else:
        docker_cfg = {**cfg.to_dict(), "container": {**cfg.to_dict()["container"],
                                                     "engine": "docker"}}
        from ddpflow.config import from_dict

        record.update(build(from_dict(docker_cfg), context, out))
        subprocess.run(["apptainer", "build", "--force", str(sif.with_suffix(".sif.tmp")),
                        f"docker-daemon://{cfg.container.image}"], check=True)
    # never a half-built image under its name
    move_into_place(sif.with_suffix(".sif.tmp"), sif, "the Apptainer image")
    from ddpflow.core.checksum import sha256_of

    record.update(engine="apptainer", sif=str(sif), source=uri or "Dockerfile",
                  sif_sha256=sha256_of(sif))
    write_json_atomic(out, record)
    return record


def _mounts(cfg: Config) -> list[Path]:
    """Host folders the stage needs, mounted at the same path inside the container."""
    paths = [Path.cwd(), Path(cfg.results_dir).resolve()]
    if cfg.data.path:
        p = Path(cfg.data.path).resolve()
        paths.append(p if p.is_dir() else p.parent)
    # the user's code and pretrained weights (outside the working folder: their own mount)
    paths += [Path(d).resolve() for d in (cfg.model.code_dir, cfg.data.code_dir) if d]
    if cfg.model.weights and Path(cfg.model.weights).is_file():
        paths.append(Path(cfg.model.weights).resolve().parent)
    keep: list[Path] = []
    for p in sorted(set(paths), key=lambda q: len(q.parts)):
        if not any(p == k or k in p.parents for k in keep):
            keep.append(p)
    return keep


def _gpu_ids() -> list[str] | None:
    """The GPUs to hand to the container, by UUID, or None where there are none. Not by
    index: Docker reads indices in NVML's (physical) order, torch's follow
    CUDA_VISIBLE_DEVICES (and CUDA_DEVICE_ORDER), so "0" can name another GPU."""
    import torch

    from ddpflow.launch.doctor import gpu_uuid

    n = torch.cuda.device_count()
    return [gpu_uuid(i) for i in range(n)] if n else None


def _caller_env(cfg: Config) -> dict[str, str]:
    """The container runs as the caller's uid, which the image's passwd may not know:
    getpass.getuser() (torch.compile asks it) then needs USER/LOGNAME. torch.compile's
    cache lives in the results folder (mounted), so a later stage reuses its kernels."""
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "ddpflow"
    return {"HOME": "/tmp", "USER": user, "LOGNAME": user,
            "TORCHINDUCTOR_CACHE_DIR": str((cfg.run_dir / "cache" / "inductor").resolve())}


def _cpuset() -> str | None:
    """This launcher's cores when a slot narrowed them (slots.py), for the container too."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cores)) if len(cores) < (os.cpu_count() or 0) else None


def run_stage(cfg: Config, resolved: Path, stage: str, extra_args: list[str],
              t0: float | None = None) -> int:
    """Run `ddpflow launch` for one stage inside the image; returns its exit code. t0: when
    the stage's command started (its wall time counts from there, container start-up
    included)."""
    from ddpflow.results.wallclock import LAUNCH_T0

    t0_env = {LAUNCH_T0: f"{time.time() if t0 is None else t0:.6f}"}
    argv = ["ddpflow", "launch", "--config", str(resolved.resolve()), "--stage", stage,
            *extra_args]
    gpus = _gpu_ids()
    mounts = _mounts(cfg)
    if cfg.container.engine == "apptainer":
        sif = cfg.run_dir / "image.sif"
        cmd = ["apptainer", "exec", *(["--nv"] if gpus else []),
               *[x for m in mounts for x in ("--bind", f"{m}:{m}")],
               "--env", f"{IN_CONTAINER}=apptainer:{sif}",
               "--env", f"{LAUNCH_T0}={t0_env[LAUNCH_T0]}", str(sif), *argv]
        return subprocess.call(cmd)
    import docker

    c = client(cfg.container.engine)
    info = reading.read_json_if_present(
        cfg.run_dir / "image.json", IMAGE_SCHEMA, "the run's container image record",
        "build the image again with `ddpflow image --config ...`") or {}
    image = info.get("image_id") or cfg.container.image
    requests = ([docker.types.DeviceRequest(device_ids=gpus, capabilities=[["gpu"]])]
                if gpus else [])
    print(f"ddpflow: running in {cfg.container.engine} image {image[:19]} "
          f"({len(gpus or [])} GPU(s), shm {cfg.container.shm_size})", file=sys.stderr)
    container = c.containers.run(
        image, argv, detach=True, working_dir=str(Path.cwd()),
        user=f"{os.getuid()}:{os.getgid()}",
        environment={IN_CONTAINER: f"{cfg.container.engine}:{image}", **_caller_env(cfg),
                     **t0_env},
        volumes={str(m): {"bind": str(m), "mode": "rw"} for m in mounts},
        shm_size=cfg.container.shm_size, device_requests=requests, init=True,
        network_mode="host", cpuset_cpus=_cpuset())

    def forward(signum, _frame):  # preemption reaches the ranks inside
        container.kill(signal="SIGTERM")

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        for line in container.logs(stream=True, follow=True):
            sys.stderr.write(line.decode(errors="replace"))
        rc = container.wait()["StatusCode"]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        container.remove(force=True)
    return rc
