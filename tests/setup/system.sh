#!/usr/bin/env bash
# Everything the tests need beyond the Python packages, installed and started here:
# a Docker engine with a small local base image (tests/setup/docker.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/docker.sh"
