#!/usr/bin/env bash
# Fetch into .whl/ (ignored) the wheels the GPU machine lacks and has no network to get, for its Python 3.12
# on x86_64: nvshmem4py (the NVSHMEM teams' bootstrap), nvidia-cutlass (CuTe headers), and transformers with
# the packages it imports that the machine lacks (tests/test_hf_integration.py fails at collection without
# it, and with it the whole one-process run of scripts/h200_check.sh). The device call carries the folder
# (`carry: [".whl"]`) and scripts/device_env.sh installs it there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "nvshmem4py-cu13==0.4.1" "nvidia-cutlass==4.2.0" \
  "transformers==5.25.0" huggingface_hub hf-xet tokenizers safetensors regex httpx2 httpcore2 truststore h11 anyio \
  idna certifi click typer shellingham annotated-doc
ls -l .whl
