#!/usr/bin/env bash
# Everything the tests need beyond the Python packages, installed and started here:
# a Docker engine with a small local base image (tests/setup/docker.sh) and Debian's
# Chromium for looking at the HTML report headless, and a one-node Slurm cluster with two
# fake GPUs (tests/setup/slurm.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
fi
bash "$here/docker.sh"
bash "$here/slurm.sh"
