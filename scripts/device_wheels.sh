#!/usr/bin/env bash
# Fetch into .whl/ (ignored) the wheels the GPU machine lacks and has no network to get, for its Python 3.12
# on x86_64: nvshmem4py (the NVSHMEM teams' bootstrap), nvidia-cutlass (CuTe headers), and transformers with
# the packages it imports that the machine lacks (tests/test_hf_integration.py fails at collection without
# it, and with it the whole one-process run of scripts/h200_check.sh). The device call carries the folder
# (`carry: [".whl"]`) and scripts/device_env.sh installs it there. The transformers set is pinned to the releases
# the CPU test environment resolved when these were fetched, so that both machines test the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "nvshmem4py-cu13==0.4.1" "nvidia-cutlass==4.2.0" \
  transformers==5.25.0 huggingface_hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.12.2 \
  httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 idna==3.21 certifi==2026.10.19.post1 \
  click==8.5.1 typer==0.29.2 shellingham==1.5.4 annotated-doc==0.0.7
ls -l .whl
