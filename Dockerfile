# syntax=docker/dockerfile:1
# pagedserve images (k8s/README.md deploys them):
#   CPU (default):  docker build -t pagedserve:cpu .
#   GPU:            docker build --build-arg VARIANT=gpu -t pagedserve:gpu .
#   CPU, no registry: k8s/build-cpu-image.sh (podman, on a debootstrap'd Debian base)
# VARIANT picks the base: slim Python for cpu, the CUDA toolkit for gpu. The builder
# stage makes a venv on that same base and the final stage copies only the venv, the
# pre-fetched default model and nothing else.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The CPU base's interpreter: the python images keep theirs in /usr/local; a plain Debian
# base (k8s/build-cpu-image.sh makes one with debootstrap) has its own in /usr/bin.
ARG CPU_PYTHON=/usr/local/bin/python3
# flashinfer compiles its attention kernels with nvcc on first use, so the GPU image needs
# the toolkit, not just the runtime. Match its CUDA major version to torch's: python -c
# "import torch; print(torch.version.cuda)". The server builds every kernel it can run in
# its warm-up, before readiness; to build them once instead of at every pod start, bake a
# kernel cache (it needs a GPU, so not in `docker build`): run the image on a GPU build host
# or as an init container with the serving settings and a volume at the cache directory,
#   pagedserve warmup --kernel-cache-dir /var/cache/pagedserve/kernels   (same settings as serve)
# and serve with PAGEDSERVE_KERNEL_CACHE_DIR pointing at the same volume (k8s/README.md).
# flashinfer also ships prebuilt kernels as flashinfer-cubin and flashinfer-jit-cache (the
# latter from flashinfer's own wheel index, per CUDA version); they must match the installed
# flashinfer-python version exactly, so they are not pinned here.
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu24.04

FROM ${PYTHON_IMAGE} AS base-cpu
ARG CPU_PYTHON
ENV PYTHON=${CPU_PYTHON}

FROM ${CUDA_IMAGE} AS base-gpu
# Ubuntu 24.04's python3 is 3.12, as on the CPU image; the distribution's own version of it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHON=/usr/bin/python3

# The stage named by the build arg; hadolint cannot see that it is a stage, not an image.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache

FROM base AS builder
ARG VARIANT
# torch first, so pip does not choose a build for us: the pinned 2.13.0 on both images (the
# top of pyproject's range). Where the registry's plain torch wheel is a CUDA build, give the
# CPU image --build-arg TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# to keep it small.
ARG TORCH_VERSION=2.13.0
ARG TORCH_PIP_ARGS=
# A CA bundle pip trusts instead of its own, for a build behind a TLS-inspecting proxy: the
# builder mounts the file for the build alone (k8s/build-cpu-image.sh does); unset, pip's own.
ARG PIP_CERT
# torch is pinned; hadolint takes $TORCH_PIP_ARGS for an unpinned package.
# hadolint ignore=DL3013
RUN "$PYTHON" -m venv /opt/venv \
 && pip install $TORCH_PIP_ARGS "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY service service
COPY clients clients
COPY proto proto
# This project, its dependencies bounded by pyproject.toml; the gpu extra adds flashinfer and
# triton (flashinfer compiles kernels on first use with the toolkit of the devel base).
# hadolint ignore=DL3013
RUN if [ "$VARIANT" = gpu ]; then pip install ".[gpu]"; else pip install .; fi
# The embedded default model (SmolLM2 GGUF, ~100 MB) is baked in at build time, so a pod
# starts with no network; a real model comes from a mounted volume (PAGEDSERVE_MODEL).
RUN pagedserve models pull

FROM base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="async gRPC LLM serving (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=10001:10001 /opt/pagedserve /opt/pagedserve
# A fixed numeric uid, so runAsNonRoot can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 pagedserve \
 && useradd --system --uid 10001 --gid pagedserve --home-dir /home/pagedserve --create-home pagedserve \
 && mkdir -p /models \
 && chown pagedserve:pagedserve /models
USER 10001:10001
WORKDIR /home/pagedserve
# The settings come from a config file, the same one the k8s ConfigMap carries (mounted
# over /etc/pagedserve there): every interface, gRPC 50051, REST 8000, metrics 9090. It is
# read last (flag > env > file), so a PAGEDSERVE_* env var or a flag overrides any key.
COPY k8s/base/pagedserve.toml /etc/pagedserve/pagedserve.toml
ENV PAGEDSERVE_CONFIG=/etc/pagedserve/pagedserve.toml
# A model volume goes here: PAGEDSERVE_MODEL=/models/<dir or .gguf>; unset serves the
# default model baked in above.
VOLUME ["/models"]
# gRPC, the OpenAI-compatible REST shim, Prometheus /metrics
EXPOSE 50051 8000 9090
# exec form: pagedserve is PID 1 and gets SIGTERM itself, then drains (k8s/README.md).
ENTRYPOINT ["pagedserve", "serve"]
