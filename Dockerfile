# ddpflow image: the package on a CUDA-enabled PyTorch base.
#   docker build -t ddpflow:latest .                      (default base: official PyTorch CUDA runtime)
#   docker build --build-arg BASE_IMAGE=<image> -t ddpflow:latest .
#   docker build --build-arg REQUIRE_CUDA=0 ...           (a CPU-only image: no CUDA check)
# The base must bring Python 3.10+ and torch (CUDA build for GPUs); ddpflow adds its few
# pure-Python needs. Training runs as the calling user (the workflow passes --user).
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="ddpflow" \
      org.opencontainers.image.description="DDP + AMP training stages with torchrun" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# torch.compile (Triton, and inductor on the CPU) needs a C compiler, which the -runtime
# bases leave out: installed unless the base has one (Debian/Ubuntu bases)
RUN command -v cc >/dev/null 2>&1 || { apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; }
WORKDIR /opt/ddpflow
COPY pyproject.toml README.md ./
COPY workflow/schemas/config.schema.yaml workflow/schemas/config.schema.yaml
COPY src ./src
# runtime needs only (nvidia-ml-py: GPU utilisation, memory and driver through NVML);
# already-present packages (from the base) are kept as they are
ARG REQUIRE_CUDA=1
RUN python3 -m pip install "setuptools>=64" "numpy>=1.24" "pyyaml>=6" "jsonschema>=4.18" "tqdm>=4.60" \
        "pillow>=9" "nvidia-ml-py>=12" \
    && python3 -m pip install --no-deps --no-build-isolation . \
    && python3 -c "import ddpflow, torch; print('ddpflow', ddpflow.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    && if [ "$REQUIRE_CUDA" = 1 ]; then python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda else 'the base image has a torch without CUDA: use a CUDA build of PyTorch (or --build-arg REQUIRE_CUDA=0 for a CPU-only image)')"; fi

# a user of uid 1000 for running without --user; bases that already have one (Ubuntu 24.04)
# keep theirs. The workflow runs the container as the caller (--user), whose uid may have no
# passwd entry: it sets USER/LOGNAME for getpass, and HOME=/tmp.
RUN getent passwd 1000 >/dev/null || useradd --create-home --uid 1000 ddpflow
USER 1000
WORKDIR /work
ENTRYPOINT []
CMD ["ddpflow", "--help"]
