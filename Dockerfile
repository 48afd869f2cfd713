# ckptd service image: slim, non-root, CPU PyTorch by default.
#
#   docker build -t ckptd:0.1.0 .                                # CPU torch on python:3.11-slim
#   docker build -t ckptd:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 .
#
# For CUDA, pick an index that publishes the pinned torch (PyTorch's install
# matrix) and a base image of the same CUDA major version.
#
# Behind a registry mirror (docs/deployment.md, "From a registry mirror"): the build pulls
# BASE_IMAGE and nothing else (no `# syntax=` frontend image), and fetches Python packages from
# PIP_INDEX_URL and torch from TORCH_INDEX:
#
#   docker build -t mirror.example.com/ml/ckptd:0.1.0 \
#     --build-arg BASE_IMAGE=mirror.example.com/library/python:3.11-slim-bookworm \
#     --build-arg PIP_INDEX_URL=https://mirror.example.com/pypi/simple \
#     --build-arg TORCH_INDEX=https://mirror.example.com/pytorch/whl/cpu .
#
# The entry command is `ckptd serve` (ENTRYPOINT + CMD below); any other ckptd
# command runs with the same image by passing its arguments (the Kubernetes
# reshard Job passes `reshard-worker --plan URI --index I`).

ARG BASE_IMAGE=python:3.11-slim-bookworm
# Where torch comes from: the CPU wheels by default, a CUDA index (cu126, cu128, ...) for GPU images.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Where every other Python package comes from (a PyPI mirror's simple index).
ARG PIP_INDEX_URL=https://pypi.org/simple

FROM ${BASE_IMAGE} AS base
# Python is already in python:* images; CUDA base images (Ubuntu) get the distribution's python3.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

FROM base AS build
ARG TORCH_INDEX
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY constraints.txt ./
# torch first, from its own index and pinned by constraints.txt; it is then already satisfied below.
RUN /opt/venv/bin/pip install --index-url "${TORCH_INDEX}" -c constraints.txt torch
COPY pyproject.toml README.md ./
COPY ckptd ./ckptd
COPY client ./client
COPY schemas ./schemas
RUN /opt/venv/bin/pip install --index-url "${PIP_INDEX_URL}" -c constraints.txt ".[server,s3]"

FROM base AS runtime
RUN groupadd --system --gid 10001 ckptd \
    && useradd --system --uid 10001 --gid ckptd --home-dir /data --shell /usr/sbin/nologin ckptd \
    && mkdir -p /data \
    && chown ckptd:ckptd /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} \
    CKPTD_ROOT=/data \
    CKPTD_HOST=0.0.0.0 \
    CKPTD_PORT=8470
WORKDIR /data
VOLUME ["/data"]
USER 10001:10001
EXPOSE 8470
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CKPTD_PORT', '8470'), timeout=4)"]
ENTRYPOINT ["ckptd"]
CMD ["serve"]
