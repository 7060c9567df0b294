#!/usr/bin/env bash
# Fetch into .whl/ (ignored) the wheels the GPU machine lacks and has no network to get: nvshmem4py (the
# NVSHMEM teams' bootstrap) and nvidia-cutlass (CuTe headers), for its Python 3.12 on x86_64. The device
# call carries the folder (`carry: [".whl"]`) and scripts/device_env.sh installs it there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "nvshmem4py-cu13==0.4.1" "nvidia-cutlass==4.2.0"
ls -l .whl
