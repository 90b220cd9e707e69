# syntax=docker/dockerfile:1
# Production image of the ONNX CNN model server for NVIDIA GPUs.
#
#   docker build -t onnx-cnn-serve .
#   docker run --gpus all -p 127.0.0.1:8000:8000 -p 127.0.0.1:8001:8001 -v onnx-models:/models onnx-cnn-serve
#   (or: docker compose -f docker/compose.yaml up; see that file)
#
# Base image: NVIDIA's official CUDA 13 + cuDNN 9 runtime image rather than a slim Python image with
# `onnxruntime-gpu[cuda,cudnn]`. The onnxruntime-gpu wheel we pin (1.31) links libcudart.so.13,
# libcublas.so.13 and cuDNN 9; the NVIDIA image ships exactly those libraries on the default loader
# path (no `onnxruntime.preload_dlls()` needed), is the image NVIDIA patches and supports, and
# carries NVIDIA_REQUIRE_CUDA so the NVIDIA container toolkit refuses to start it on a host driver
# too old for CUDA 13 with a clear message instead of a failing CUDA EP at model load. The pip CUDA
# wheels would give a similar size (~3 GB either way: cuDNN and cuBLAS dominate). Ubuntu 24.04
# brings Python 3.12. On a host without a GPU the same image serves on the CPU provider
# (SERVICE_DEVICE=cpu; compose profile "cpu").
ARG BASE_IMAGE=nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04
# The fused CUDA operators (kernels/) are compiled with the same CUDA release's toolkit image, for these GPU
# generations (A100, A10/RTX 30, L4/RTX 40, H100/H200); the library links the CUDA runtime statically.
ARG KERNELS_IMAGE=nvidia/cuda:13.0.3-devel-ubuntu24.04
ARG KERNEL_ARCHS=80,86,89,90
# ONNX Runtime's C/C++ headers come from one pinned Debian archive, checked by size and sha256
# (kernels/ort_headers.py), fetched where ORT_HEADERS_URL says (a build argument) or else from the first
# Debian mirror of the fetching stage's own apt sources: a Debian image's, since the toolkit image is Ubuntu's.
ARG HEADERS_IMAGE=debian:trixie-slim
ARG ORT_HEADERS_URL=

# ---------------------------------------------------------------------------------------------
# ONNX Runtime's headers for the kernels (nothing else is fetched; only the include folder is kept).
# ---------------------------------------------------------------------------------------------
FROM ${HEADERS_IMAGE} AS ort-headers
ARG ORT_HEADERS_URL
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY kernels ./kernels
RUN python3 -m kernels.ort_headers /opt/ort-include

# ---------------------------------------------------------------------------------------------
# Kernels: libonnxcnn_ops.so, the ai.onnxcnn fused operators, built against those headers.
# ---------------------------------------------------------------------------------------------
FROM ${KERNELS_IMAGE} AS kernels
ARG KERNEL_ARCHS
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY kernels ./kernels
COPY --from=ort-headers /opt/ort-include /opt/ort-include
RUN python3 -m kernels.build --archs "${KERNEL_ARCHS}" --out-dir /opt/onnxcnn --headers /opt/ort-include --no-fetch

# ---------------------------------------------------------------------------------------------
# Builder: a virtual environment in /opt/venv with the dependencies, then the package.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Distribution packages are not version-pinned: the base image tag pins the distribution, and
# pinning Ubuntu's patch versions breaks the build whenever the archive moves on (security fixes).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /src

# Dependencies first, in their own layer, read from pyproject.toml alone: editing the service's
# source does not reinstall onnxruntime and friends. EXTRAS (comma-separated optional-dependency groups)
# adds extras: the CPU image (compose service serve-cpu) is built with EXTRAS=openvino, the OpenVINO
# execution provider plugin (~53 MB wheel, no dependencies) that the CPU tuner times against ORT's CPU
# provider (it serves Intel CPUs; elsewhere it stays unused).
ARG EXTRAS=""
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in os.environ.get('EXTRAS', '').split(',') if e]; print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt

# Then the package itself (no dependency resolution: they are all there already).
COPY README.md ./
COPY service ./service
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import service.settings"

# ---------------------------------------------------------------------------------------------
# Runtime: the CUDA runtime, Python, the venv and a non-root user. No compilers, no pip cache.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="onnx-cnn-serve" \
      org.opencontainers.image.description="ONNX model server for PyTorch-exported CNNs: graph fusion, CUDA graphs, dynamic batching, KServe V2."

# Same Python as the builder (same base, same archive), so the venv's interpreter link resolves.
# A fixed non-root uid/gid (10001) that hosts can chown a bind-mounted model directory to.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin app \
    && mkdir -p /models \
    && chown app:app /models

# The venv stays owned by root: the service user cannot modify its own code.
COPY --from=builder /opt/venv /opt/venv
COPY --from=kernels /opt/onnxcnn/libonnxcnn_ops.so /opt/onnxcnn/libonnxcnn_ops.so
COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/entrypoint.sh

# SERVICE_HOST=0.0.0.0: inside the container the server must listen on the container's own network
# interface, because a published port (-p 127.0.0.1:8000:8000) forwards to that interface, not to
# the container's loopback. It is not exposed beyond the host unless the port is published so:
# compose binds it to the host's 127.0.0.1. Outside a container the default stays 127.0.0.1.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SERVICE_HOST=0.0.0.0 \
    SERVICE_PORT=8000 \
    SERVICE_GRPC_PORT=8001 \
    SERVICE_MODEL_DIR=/models \
    SERVICE_FUSED_OPS_LIBRARY=/opt/onnxcnn/libonnxcnn_ops.so

# Uploaded models, their optimized forms and metadata: keep them across container restarts.
VOLUME ["/models"]
WORKDIR /models
USER 10001:10001
# REST (KServe V2, /predict, management, /metrics) and KServe V2 gRPC.
EXPOSE 8000 8001

# Ready means every stored model is optimized, loaded and warmed (CUDA graphs captured); the
# load-time autotuner and cuDNN's exhaustive search can take minutes on a new GPU, hence the
# start period. Python's urllib needs no curl in the image; non-2xx raises, so the exit code is 1.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('SERVICE_PORT', '8000'), timeout=4)"]

# SIGTERM: the server turns not-ready at once and lets in-flight requests finish
# (SERVICE_SHUTDOWN_GRACE_S, default 30 s; give `docker stop -t` / compose stop_grace_period more).
STOPSIGNAL SIGTERM
# CMD is set explicitly: the Ubuntu base would otherwise pass its CMD ["/bin/bash"] to the entrypoint.
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["serve"]
