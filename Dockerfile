# syntax=docker/dockerfile:1.7
#
# voxpipe images. One Dockerfile, two targets:
#
#   docker build --target stage   -t voxpipe/stage:0.1.0   .   # CUDA: thinker | talker | code2wav
#   docker build --target gateway -t voxpipe/gateway:0.1.0 .   # slim, CPU only
#
#   docker run --gpus all -v /srv/qwen3-omni:/models/qwen3-omni:ro -p 50052:50052 \
#       -e VOXPIPE_CODE2WAV=code2wav:50053 \
#       voxpipe/stage:0.1.0 talker --model /models/qwen3-omni --port 50052 --device cuda
#
# Stages call the next stage themselves: a thinker sends spoken replies on to the talkers named by
# --talker / VOXPIPE_TALKER, a talker its codec frames to the code2wav replicas named by
# --code2wav / VOXPIPE_CODE2WAV (host:port and/or dns:///name:port, comma-separated). The gateway
# dials the thinkers and, for the audio, the same code2wav set as the talkers; never a talker.
#
# Neither image contains model weights: mount them read-only at /models/qwen3-omni.
#
# The stage image starts from NVIDIA's CUDA *base* image (driver hooks, NVIDIA_* env for the
# container toolkit, cudart) and gets the rest of the CUDA runtime (cuBLAS, cuDNN, NCCL, ...) from
# the nvidia-* wheels that the CUDA build of torch pulls in, so the libraries are not shipped twice.
# Pass --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 to use the runtime image.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG TORCH_VERSION=2.8.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# ---------------------------------------------------------------------------------------------
# stage-builder: a virtualenv at /opt/venv with CUDA torch and voxpipe
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS stage-builder

ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: it is by far the largest download and changes least often.
RUN pip install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README* ./
COPY voxpipe/ voxpipe/
COPY proto/ proto/
COPY services/ services/
COPY gateway/ gateway/
COPY kernels/ kernels/
COPY bench/ bench/
RUN pip install . \
    && python -c "import torch, voxpipe, voxpipe.v1.stages_pb2; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---------------------------------------------------------------------------------------------
# stage: runtime image for the three GPU stage services
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS stage

LABEL org.opencontainers.image.title="voxpipe-stage" \
      org.opencontainers.image.description="voxpipe GPU stage service (thinker | talker | code2wav)" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3.12: the interpreter the venv links to. gcc, libc6-dev and python3.12-dev: Triton (shipped
# with torch) compiles a small C launcher with the system compiler the first time a kernel runs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 voxpipe \
    && useradd --system --uid 10001 --gid voxpipe --create-home --home-dir /home/voxpipe \
       --shell /usr/sbin/nologin voxpipe \
    && mkdir -p /models \
    && chown voxpipe:voxpipe /models

COPY --from=stage-builder /opt/venv /opt/venv

# HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE: weights and tokenizer come from the mounted model directory,
# never from a hub. VOXPIPE_HOST: every listener on all interfaces (voxpipe's default is 127.0.0.1). NVIDIA_*: what the container toolkit exposes (base images set these already).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VOXPIPE_HOST=0.0.0.0 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
WORKDIR /home/voxpipe

# 50051 thinker, 50052 talker, 50053 code2wav (gRPC); 9090 Prometheus /metrics.
EXPOSE 50051 50052 50053 9090

# The stage (and so its port) is chosen by the arguments. Set VOXPIPE_GRPC_PORT when a stage runs
# on a port other than its default; otherwise the check passes when any default stage port serves.
# In Kubernetes the native gRPC probes are used instead (deploy/k8s).
HEALTHCHECK --interval=30s --timeout=10s --start-period=15m --retries=3 \
    CMD ["bash", "-c", "for p in ${VOXPIPE_GRPC_PORT:-50051 50052 50053}; do python -m voxpipe.cli health --addr localhost:$p && exit 0; done; exit 1"]

ENTRYPOINT ["voxpipe"]
CMD ["thinker", "--model", "/models/qwen3-omni", "--port", "50051", "--device", "cuda", "--metrics-port", "9090"]

# ---------------------------------------------------------------------------------------------
# gateway-builder: CPU-only torch (the package depends on torch; the gateway never touches a GPU)
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway-builder

ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README* ./
COPY voxpipe/ voxpipe/
COPY proto/ proto/
COPY services/ services/
COPY gateway/ gateway/
COPY kernels/ kernels/
COPY bench/ bench/
RUN pip install . \
    && python -c "import torch, voxpipe, voxpipe.v1.stages_pb2; assert not torch.version.cuda"

# ---------------------------------------------------------------------------------------------
# gateway: HTTP/WebSocket (8000) + gRPC (50050) front door
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway

LABEL org.opencontainers.image.title="voxpipe-gateway" \
      org.opencontainers.image.description="voxpipe HTTP/WebSocket gateway" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 voxpipe \
    && useradd --system --uid 10001 --gid voxpipe --create-home --home-dir /home/voxpipe \
       --shell /usr/sbin/nologin voxpipe

COPY --from=gateway-builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VOXPIPE_HOST=0.0.0.0

USER 10001:10001
WORKDIR /home/voxpipe

EXPOSE 8000 50050

# The slim image has no curl: ask /health with the standard library.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]

# Defaults suit a compose file whose services are named thinker, talker and code2wav (whose thinker
# runs with VOXPIPE_TALKER=talker:50052 and talker with VOXPIPE_CODE2WAV=code2wav:50053: the same
# code2wav address as here).
ENTRYPOINT ["voxpipe"]
CMD ["gateway", "--thinker", "thinker:50051", "--code2wav", "code2wav:50053", "--http-port", "8000", "--grpc-port", "50050"]
