#!/usr/bin/env bash
# The two-block cluster variant with the last tiles of two experts whose tiles are odd in number run as
# one unit (each block its own expert's tile and weight panels), where main pairs each such tile with an
# empty one whose block streams weights for no rows (docs/perf-notes.md, "Next steps": built, not yet run
# on a GPU). The change is scripts/probes/cluster_units.patch; this times it against the working tree's
# kernel in one run (scripts/forward_ab.sh, side "base" = the patched kernel, "new" = this tree's), the
# cluster variant and the default beside it, and compares the outputs' digests (bitwise equal expected).
# Then the cluster variant's GPU tests on the patched kernel. On a GPU machine:
#   bash scripts/cluster_units_probe.sh            (AB_SHAPES, AB_ROUNDS pass through)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
declare -A PATCH=(
  [units]=scripts/probes/cluster_units.patch
)
probe_patch cluster_units "${PATCH[units]}" || exit 1
export QUICK_VARIANTS=${QUICK_VARIANTS:-tma-wgmma-128x256-4stage-prefetch-cluster2,tma-wgmma-128x256-4stage-prefetch}
AB_BASE=/tmp/probe_src_cluster_units AB_ROUNDS=${AB_ROUNDS:-2} \
  AB_SHAPES=${AB_SHAPES:-8192/2048/2048/32/2/gelu,4096/2048/1024/64/8/swiglu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu,16384/2048/1408/64/6/swiglu,128/4096/1408/64/6/gelu} \
  timeout 400 bash "$(dirname "$0")/forward_ab.sh"
unset QUICK_VARIANTS
FLASHDMOE_SOURCE_DIR=/tmp/probe_src_cluster_units FLASHDMOE_CACHE_DIR=/tmp/ab_base_cache timeout 150 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_gpu.py tests/test_ep_emulated_gpu.py -k cluster
