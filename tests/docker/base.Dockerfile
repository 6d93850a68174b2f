# A small local stand-in for a PyTorch base image, for the tests only (CPU torch, offline).
FROM ddpflow-test-root:bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
COPY wheels /tmp/wheels
RUN python3 -m pip install --no-index --find-links /tmp/wheels --break-system-packages \
        torch numpy pyyaml jsonschema tqdm pillow setuptools nvidia-ml-py \
    && rm -rf /tmp/wheels /root/.cache
