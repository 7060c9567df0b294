# syntax=docker/dockerfile:1
#
# FlashDMoE image: the CUDA 13.0 toolchain (nvcc compiles the fused kernel), PyTorch built for CUDA 13.0,
# NVSHMEM + nvshmem4py, Ray, and the extension compiled for Hopper (sm_90a) at image build time, so
# pods start without a compile step. The k8s/ manifests run this image; docs/deploy.md builds it:
#
#   docker build -t flashdmoe:0.1.0 .
#
# The devel flavour stays at run time on purpose: loading the extension looks up nvcc (its version is
# part of the build-cache key), and a pod can rebuild (`flashdmoe build --force`) if sources change --
# into a writable FLASHDMOE_CACHE_DIR: the k8s/ pods run on a read-only root file system, where loading
# the kernel built below writes nothing.
FROM nvcr.io/nvidia/cuda:13.0.2-devel-ubuntu24.04

# Version of this image; the k8s/ manifests pull flashdmoe:<this>, tests/test_deploy.py checks they agree.
LABEL org.opencontainers.image.title="flashdmoe" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="FlashDMoE: a distributed MoE layer as one persistent GPU kernel"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3 is 3.12 on Ubuntu 24.04 (the version the GPU machines run); -dev for pybind11's Python.h;
# g++ is nvcc's host compiler; wget is what KubeRay's default readiness/liveness probes call.
# libibverbs1 + ibverbs-providers (libmlx5) are the RDMA user space that NVSHMEM's InfiniBand transport and
# NCCL's load across nodes (k8s/components/multinode); ibverbs-utils (ibv_devinfo) checks a pod's HCAs.
# Apt packages follow the pinned base image's Ubuntu archive snapshot rather than exact versions:
# Ubuntu drops superseded .debs from its mirrors, so exact pins break rebuilds within weeks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
        g++ \
        ibverbs-providers \
        ibverbs-utils \
        libibverbs1 \
        python3 \
        python3-dev \
        python3-venv \
        wget \
    && rm -rf /var/lib/apt/lists/*

# Unprivileged user with a fixed numeric id, so Kubernetes' runAsNonRoot can verify it and the pods'
# runAsUser/fsGroup (k8s/base/*.yaml) match. 10001 avoids Ubuntu 24.04's built-in "ubuntu" user (1000).
# The pods mount a writable emptyDir on its home directory (Ray's token, caches).
ARG APP_UID=10001
RUN groupadd --gid "${APP_UID}" flashdmoe \
    && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --home-dir /home/flashdmoe --shell /bin/bash flashdmoe \
    && install -d -o flashdmoe -g flashdmoe /opt/venv /opt/flashdmoe /opt/flashdmoe-cache

# Multicast/NVLS stays off everywhere (see docs/deploy.md); PYTHONUNBUFFERED so the results table
# reaches `kubectl logs` as it is printed. The extension cache has a fixed path (not ~/.cache) so the
# kernel built below is found whatever HOME a pod ends up with.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVSHMEM_DISABLE_NVLS=1 \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    FLASHDMOE_CUDA_ARCH=sm_90a \
    FLASHDMOE_CACHE_DIR=/opt/flashdmoe-cache

# Everything from here on runs as the unprivileged user: the venv, the source tree and the extension
# build cache all belong to the user the pods run as.
USER 10001:10001
WORKDIR /opt/flashdmoe

# The GPU runtime stack, pinned, in its own layer (it is several GB and changes rarely):
# - torch 2.11.0 from PyPI is the CUDA 13.0 build (it requires cuda-toolkit==13.0.2, matching the base).
# - nvidia-nvshmem-cu13 must be the exact version torch pins: torch, nvshmem4py and the extension all
#   load the one libnvshmem_host.so.3. Listed here so a torch bump that moves it fails loudly (pip
#   cannot resolve two different pins) instead of drifting. To read the pin of a torch release:
#     python -c "import importlib.metadata as m; print([r for r in m.requires('torch') if 'nvshmem' in r])"
#   run wherever that torch is installed (torch 2.11.0 -> nvidia-nvshmem-cu13==3.4.5).
# - ray[default] carries the dashboard/job server KubeRay needs; it is spec.rayVersion in k8s/.
RUN python3 -m venv /opt/venv \
    && python -m pip install \
        torch==2.11.0 \
        nvidia-nvshmem-cu13==3.4.5 \
        nvshmem4py-cu13==0.4.1 \
        "ray[default]==2.60.0"

# The project itself, installed editable so the kernel sources (csrc/) and configs/ stay beside the
# package where the extension builder and `flashdmoe run --config configs/...` find them. Then the
# fused kernel is compiled for Hopper, twice: the main build and the NVSHMEM build (relocatable device
# code, NVSHMEM's device library linked in) that a team across nodes runs (FLASHDMOE_KERNEL_BUILD=nvshmem,
# set by the multinode component and by the Ray driver for nodes > 1); then the host module (C++ against
# the image's torch: the forward's launch path). No GPU exists during `docker build`: the builder takes the
# architecture from FLASHDMOE_CUDA_ARCH and only runs nvcc. `flashdmoe info` shows what was built.
COPY --chown=10001:10001 . /opt/flashdmoe
RUN python -m pip install --editable ".[gpu]" \
    && python -m pip check \
    && flashdmoe build \
    && flashdmoe build --nvshmem \
    && flashdmoe build --host \
    && flashdmoe info

ENTRYPOINT ["flashdmoe"]
CMD ["info"]
