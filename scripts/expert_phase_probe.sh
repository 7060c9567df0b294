#!/usr/bin/env bash
# Where the expert phase's time goes (docs/perf-notes.md, "The expert phase taken apart"): the default
# kernel built from copies of csrc/ with one part removed, each timed by scripts/quick_time.py. Results
# are meaningless (parts are missing); only the times are. On a GPU machine:
#   PROBES="base noepi nomma noact nostore" bash scripts/expert_phase_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
declare -A EDIT=(
  [base]=''
  # no tile epilogue: neither activation nor stores (the counters and barriers stay)
  [noepi]='s/^\(\s*\)gemm1_epilogue_warp</\1if (p.tokens < 0) gemm1_epilogue_warp</; s/^\(\s*\)gemm2_epilogue_warp</\1if (p.tokens < 0) gemm2_epilogue_warp</'
  # no wgmma: the loads and the epilogue only
  [nomma]='s/^\(\s*\)wgmma::wgmma_m64nNk16<BN, Element>/\1if (desc_a == 1) wgmma::wgmma_m64nNk16<BN, Element>/'
  # no activation: the accumulators stored as they are
  [noact]='s/return activate(Activation::Gelu, acc(j, h, v));/return acc(j, h, v);/; s/return silu(acc(j, h, v)) \* acc(j + BN \/ 16, h, v);/return acc(j, h, v) * acc(j + BN \/ 16, h, v);/'
  # no global stores: the activation computed, nothing written
  [nostore]='s/if (4 \* i + read_row < rows) \*reinterpret_cast/if (4 * i + read_row < rows - (1 << 30)) *reinterpret_cast/'
)
export QUICK_VARIANTS=${QUICK_VARIANTS:-tma-wgmma-128x256-4stage-prefetch} FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
for probe in ${PROBES:-base noepi nomma noact nostore}; do
  src=/tmp/probe_src_$probe
  rm -rf "$src" && cp -r csrc "$src"
  sed -i "${EDIT[$probe]}" "$src"/moe/expert_pipeline.cuh "$src"/moe/tile_gemm_tma.cuh "$src"/moe/epilogue.cuh
  [ "$probe" = base ] || ! diff -rq csrc "$src" > /dev/null || { echo "$probe: the edit matched nothing"; exit 1; }
  export FLASHDMOE_SOURCE_DIR=$src FLASHDMOE_CACHE_DIR=/tmp/probe_cache_$probe
  timeout 300 python3 -m flashdmoe build > "$OUT/build_$probe.log" 2>&1 || { echo "$probe: build failed"; continue; }
  QUICK_SHAPES=8192/2048/2048/32/2,16384/2048/8192/8/1 timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -v attributes | grep prefetch | sed "s/^/$probe gelu /"
  QUICK_ACTIVATION=swiglu QUICK_SHAPES=4096/4096/14336/8/2,8192/2048/768/128/8 timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -v attributes | grep prefetch | sed "s/^/$probe swiglu /"
done
