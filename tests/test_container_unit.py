"""The container engines as a user's settings point at them (launch/container.py): podman at
the first of its sockets that exists, or at DOCKER_HOST only; docker at the user's current
docker context; and a signal to the launcher outside reaching the stage inside its
container. Fast: the real Docker engine (tests/setup/system.sh) and its `docker` command,
one small image built on the local root file system, no training.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.launch import container
from ddpflow.launch.container import IN_CONTAINER

ENGINE_SOCKET = "/var/run/docker.sock"  # the Docker engine on this machine
DOCKER = shutil.which("docker")  # (before a test empties PATH)
PODMAN_START = "start its API with `podman system service --time=0 &`"


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.fixture
def no_host(tmp_path, monkeypatch):
    """No DOCKER_HOST, no docker context of the user's, and neither engine on PATH."""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv("DOCKER_CONTEXT", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return monkeypatch


# ------------------------------------------------------------------ podman: which socket

def test_podman_is_reached_at_its_first_socket_not_a_later_dead_one(tmp_path, no_host):
    """(the Docker engine's socket stands in for podman's: both answer the Docker API)"""
    no_host.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "podman").mkdir()
    (tmp_path / "podman" / "podman.sock").symlink_to(ENGINE_SOCKET)
    (tmp_path / "dead.sock").write_text("")  # exists, nothing answers there
    no_host.setattr(container, "PODMAN_SOCKETS", (str(tmp_path / "dead.sock"),))
    assert container.client("podman").ping() is True


def test_podman_without_any_socket_is_refused_naming_each(tmp_path, no_host):
    no_host.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    no_host.setattr(container, "PODMAN_SOCKETS", (str(tmp_path / "none.sock"),))
    assert _refusal(container.client, "podman") == (
        f"container.engine is 'podman', but the podman engine at "
        f"unix://{tmp_path}/podman/podman.sock or unix://{tmp_path}/none.sock does not "
        f"answer: none of these sockets exists; install it (apt-get install podman), then "
        f"{PODMAN_START}, or set container.engine: none to run the stages in the host "
        f"environment")


def test_podman_with_docker_host_is_reached_there_and_only_there(tmp_path, no_host):
    no_host.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "podman").mkdir()
    (tmp_path / "podman" / "podman.sock").symlink_to(ENGINE_SOCKET)  # not tried
    no_host.setenv("DOCKER_HOST", f"unix://{ENGINE_SOCKET}")
    assert container.client("podman").ping() is True
    no_host.setenv("DOCKER_HOST", "tcp://127.0.0.1:1")  # nothing listens on port 1
    text = _refusal(container.client, "podman")
    assert text.startswith(
        "container.engine is 'podman', but the podman engine at tcp://127.0.0.1:1 (from "
        "DOCKER_HOST) does not answer: DockerException: Error while fetching server API "
        "version: "), text
    assert text.endswith(f"; install it (apt-get install podman), then {PODMAN_START}, or "
                         f"set container.engine: none to run the stages in the host "
                         f"environment"), text


# ------------------------------------------------------------------ docker: the user's context

def _docker(*args: str) -> None:
    subprocess.run([DOCKER, *args], check=True, capture_output=True)


def test_docker_follows_the_users_current_docker_context(tmp_path, no_host):
    """`docker context use` (rootless docker, Docker Desktop) is where the engine is, not the
    system socket: a context whose engine does not answer is refused."""
    (tmp_path / "live.sock").symlink_to(ENGINE_SOCKET)
    _docker("context", "create", "unit-live", "--docker", f"host=unix://{tmp_path}/live.sock")
    _docker("context", "create", "unit-dead", "--docker", f"host=unix://{tmp_path}/dead.sock")
    _docker("context", "use", "unit-live")
    assert container.client("docker").ping() is True
    _docker("context", "use", "unit-dead")
    text = _refusal(container.client, "docker")
    assert text.startswith("container.engine is 'docker', but the docker engine at "), text
    assert ("does not answer: DockerException: Error while fetching server API version: "
            in text and "\n" not in text), text


# ------------------------------------------------------------------ a signal reaches the stage

# the image: a Debian root file system (tests/setup/docker.sh) whose entry point says when it
# is up, and exits 7 on SIGTERM (0 when ten seconds pass without one)
DOCKERFILE = """FROM ddpflow-test-root:bookworm
ENTRYPOINT ["/bin/sh", "-c", "trap 'echo stopped by SIGTERM; exit 7' TERM; echo up; i=0; \
while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; echo not stopped; exit 0", "sh"]
"""


def _signal_when_up(tag: str, before, done: threading.Event) -> None:
    """SIGTERM to this process once run_stage holds the signals and the container is up."""
    c = container.client("docker")
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end and not done.is_set():
        running = c.containers.list(filters={"ancestor": tag})
        if (signal.getsignal(signal.SIGTERM) is not before and running
                and b"up" in running[0].logs()):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)


def test_a_signal_to_the_launcher_stops_the_stage_in_its_container(tmp_path, monkeypatch,
                                                                     capfd):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv(IN_CONTAINER, raising=False)
    monkeypatch.chdir(tmp_path)
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    tag = f"ddpflow-container-unit:{os.getpid()}-{tmp_path.name[-12:].lower()}"
    c = container.client("docker")
    c.images.build(path=str(context), tag=tag, rm=True, forcerm=True)
    try:
        cfg = from_dict(tiny_config(tmp_path, container={"engine": "docker", "image": tag}))
        before = signal.getsignal(signal.SIGTERM)
        done = threading.Event()
        sender = threading.Thread(target=_signal_when_up, args=(tag, before, done), daemon=True)
        sender.start()
        capfd.readouterr()
        try:
            rc = container.run_stage(cfg, cfg.run_dir / "config.json", "s1", [])
        finally:
            done.set()
            sender.join()
        err = capfd.readouterr().err.splitlines()
        assert (rc, err[1:]) == (7, ["up", "stopped by SIGTERM"]), err
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        c.images.remove(tag, force=True)
