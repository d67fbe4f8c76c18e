# syntax=docker/dockerfile:1
# Two images from one file:
#
#   docker build -t ghcr.io/pagedllm/pagedllm:0.1.0 .                                # the model server
#   docker build --target operator -t ghcr.io/pagedllm/pagedllm-operator:0.1.0 .    # the operator
#   docker run --gpus all -p 8000:8000 ghcr.io/pagedllm/pagedllm:0.1.0 --model /models/opt-125m
#
# The default (last) target `serve` is the server: CUDA, torch, Triton and pagedllm, with
# `pagedllm serve` as its entrypoint. The target `operator` is what the Helm chart runs:
# Python, kopf, the kubernetes client and pagedllm without its dependencies (the operator
# imports only the engine's configuration and CLI flags, which are torch-free).
#
# NOTE: the operator renders the server container with command ["pagedllm", "serve"];
# tests/operator/test_dockerfile.py keeps the ENTRYPOINT below equal to it, and checks that
# the sources copied here are the files a wheel build reads.

ARG CUDA_VERSION=12.4.1
ARG UBUNTU_VERSION=22.04
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- the operator -------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml setup.py README.md /src/
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
# --no-deps: the package's dependencies are the engine's (torch, transformers, ...); the
# operator needs only its extra, pyproject.toml's `operator` (a test keeps the two equal).
RUN pip install --no-deps /src \
 && pip install "kopf>=1.45" "kubernetes>=37" "prometheus-client>=0.20"

FROM ${PYTHON_IMAGE} AS operator
COPY --from=operator-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# NOTE: numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["pagedllm", "operator"]

# -- the model server ---------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_INDEX
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Not pinned: UBUNTU_VERSION fixes Python's and gcc's versions, and Ubuntu's archive drops a
# package's previous build when a security update replaces it, so exact pins stop building.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch's CUDA wheels first (they bundle cuDNN, NCCL and triton), so the project
# install below finds torch satisfied instead of pulling the CPU build.
RUN pip install --index-url ${TORCH_INDEX} "torch>=2.4"
COPY pyproject.toml setup.py README.md /src/
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
RUN pip install "/src[triton,operator]"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS serve
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its launcher at run time: it needs a C compiler and Python's headers.
# Not pinned, as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/pagedllm pagedllm \
 && mkdir -p /models && chown 1000:1000 /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/pagedllm \
    HF_HOME=/home/pagedllm/.cache/huggingface
# NOTE: numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 1000:1000
WORKDIR /home/pagedllm
EXPOSE 8000
ENTRYPOINT ["pagedllm", "serve"]
