# ddpflow image: the package on a CUDA-enabled PyTorch base.
#   docker build -t ddpflow:latest .                      (default base: official PyTorch CUDA runtime)
#   docker build --build-arg BASE_IMAGE=<image> -t ddpflow:latest .
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

WORKDIR /opt/ddpflow
COPY pyproject.toml README.md ./
COPY workflow/schemas/config.schema.yaml workflow/schemas/config.schema.yaml
COPY src ./src
# runtime needs only; already-present packages (from the base) are kept as they are
RUN python3 -m pip install "setuptools>=64" "numpy>=1.24" "pyyaml>=6" "jsonschema>=4.18" "tqdm>=4.60" \
        "pillow>=9" \
    && python3 -m pip install --no-deps --no-build-isolation . \
    && python3 -c "import ddpflow, torch; print('ddpflow', ddpflow.__version__, 'torch', torch.__version__)"

RUN useradd --create-home --uid 1000 ddpflow
USER 1000
WORKDIR /work
ENTRYPOINT []
CMD ["ddpflow", "--help"]
