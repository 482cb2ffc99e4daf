# pd-cluster serving image: the CUDA runtime, Python, a CUDA build of torch, pd-cluster (with Ray and the
# Kubernetes client of the router's discovery),
# the RDMA user-space libraries UCX needs for InfiniBand/RoCE, and what Triton needs to compile kernels.
# It runs as a non-root user (UID 1000), which is what the Helm chart's security context expects.
#
#   docker build -t registry.example.com/pd-cluster:0.1.0 .
#   docker push registry.example.com/pd-cluster:0.1.0
#   helm install pd helm/pd-cluster --set image.repository=registry.example.com/pd-cluster
#
# Another CUDA: --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04 \
#               --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129
# Weights are not in the image: mount them (see docs/deploy.md), or build FROM this image and COPY them.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TRITON_CACHE_DIR=/home/pd/.cache/triton

# Triton compiles each kernel's host launcher (a small C file including Python.h) the first time the kernel
# runs, so the image carries a C compiler (gcc, with libc6-dev) and the Python headers (python3-dev). The
# base stays the CUDA *runtime* image, not the -devel one: Triton ships its own ptxas and CUDA headers and
# needs no nvcc, so the multi-GB toolkit would add nothing. Compiled kernels are cached in TRITON_CACHE_DIR,
# which the Helm chart points at its writable /cache volume (the root filesystem is read-only there);
# the ENV default above is for plain `docker run`. Every worker compiles and runs one tiny kernel at start-up
# (pd_cluster.engine.attention.triton.selfcheck) and exits with a clear error if this toolchain is missing.
#
# python3 (3.12 on Ubuntu 24.04); rdma-core, the verbs providers (mlx5, ...) and librdmacm for UCX's
# RDMA transports; ibverbs-utils for ibv_devinfo, to check the NICs from inside a pod.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
      rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils \
 && rm -rf /var/lib/apt/lists/*

# Fail the build, not the first pod, if the toolchain above is incomplete.
RUN cc --version > /dev/null \
 && python3 -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); assert os.path.exists(h), h"

# torch first, from the CUDA index: an unpinned torch from PyPI would pull a different CUDA stack.
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --upgrade pip \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The project itself (not editable: the source tree is not needed at run time).
COPY . /tmp/pd-cluster
RUN pip install "/tmp/pd-cluster[gpu,ray,k8s,mooncake]" && rm -rf /tmp/pd-cluster \
 && pd-worker --help > /dev/null && pd-router --help > /dev/null && pd-bench --help > /dev/null

# Ubuntu images ship a user with UID 1000; replace it with ours.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 pd \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin pd
USER 1000:1000
WORKDIR /home/pd

EXPOSE 8000
# A whole local cluster (router + 1 prefill + 1 decode) on this container's GPUs; the chart runs
# pd-worker and pd-router directly instead.
CMD ["pd-serve", "--host", "0.0.0.0"]
