#!/usr/bin/env bash
# Start a real Docker engine for the tests and make the small local base image that the
# project's Dockerfile is built on (nothing can be pulled from a registry here).
#   bash tests/setup/docker.sh        (idempotent; needs root the first time)
# The base image: Debian bookworm (debootstrap) + python3 + a CPU-only torch and
# ddpflow's runtime needs (nvidia-ml-py too), installed offline from wheels downloaded on
# the host.
set -euo pipefail
BASE_TAG=${DDPFLOW_TEST_BASE:-ddpflow-test-base:bookworm-torch2.13-nvml}
here=$(cd "$(dirname "$0")" && pwd)
work=${DDPFLOW_TEST_CACHE:-/var/tmp/ddpflow-test}
mkdir -p "$work"

need() { command -v "$1" >/dev/null 2>&1; }
if ! need dockerd || ! need debootstrap; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io debootstrap >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd"
  nohup dockerd --iptables=false --bridge=none \
    >"$work/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 "$work/dockerd.log"; exit 1; }
fi

if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  echo "base image $BASE_TAG present"
  exit 0
fi

if ! docker image inspect ddpflow-test-root:bookworm >/dev/null 2>&1; then
  echo "debootstrap bookworm (minbase)"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/rootfs" -c . | docker import - ddpflow-test-root:bookworm >/dev/null
  rm -rf "$work/rootfs"
fi

echo "downloading wheels for the base image"
ctx="$work/base-context"
rm -rf "$ctx" && mkdir -p "$ctx/wheels"
# torch for the image: the small CPU build (a local version, served by PyTorch's CPU wheel
# index or by a pip configured with local wheels) where pip finds it, else the default
# wheel of the plain package index (a CUDA build: several GB with its CUDA libraries)
needs=("numpy>=1.24" "pyyaml>=6" "jsonschema>=4.18" "tqdm>=4.60" "pillow>=9" "setuptools>=64"
       "nvidia-ml-py>=12")
torch_pin=${DDPFLOW_TEST_TORCH:-2.13.0}
if ! python3 -m pip download -q -d "$ctx/wheels" "torch==${torch_pin}+cpu" "${needs[@]}"; then
  echo "torch==${torch_pin}+cpu is not served here: using the default torch==${torch_pin} wheel"
  python3 -m pip download -q -d "$ctx/wheels" "torch==${torch_pin}" "${needs[@]}"
fi
cp "$here/../docker/base.Dockerfile" "$ctx/Dockerfile"
echo "building $BASE_TAG"
docker build --network host -t "$BASE_TAG" "$ctx" >"$work/base-build.log" 2>&1 \
  || { tail -30 "$work/base-build.log"; exit 1; }
rm -rf "$ctx"
echo "base image $BASE_TAG built"
