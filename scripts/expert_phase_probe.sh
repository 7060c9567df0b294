#!/usr/bin/env bash
# Where the expert phase's time goes (docs/perf-notes.md, "The expert phase taken apart"): the default
# kernel built from copies of csrc/ with one part removed, each timed by scripts/quick_time.py. Results
# are meaningless (parts are missing); only the times are. On a GPU machine:
#   PROBES="base noepi nomma noact nostore halfb halfa" bash scripts/expert_phase_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
# Each probe: a Python expression over a file's text s (probe_build.sh).
declare -A EDIT=(
  [base]='s'
  # no tile epilogue: neither activation nor stores (the counters and barriers stay)
  [noepi]='re.sub(r"(?m)^(\s*)(gemm[12]_epilogue_warp<)", r"\1if (p.tokens < 0) \2", s)'
  # no wgmma: the loads and the epilogue only
  [nomma]='s.replace("      wgmma::Mma<BN, Element, kMajorA", "      if (desc_a == 1) wgmma::Mma<BN, Element, kMajorA")'
  # no activation: the accumulators stored as they are
  [noact]='s.replace("activate(Activation::Gelu, acc(j, h, 0))", "acc(j, h, 0)").replace("activate(Activation::Gelu, acc(j, h, 1))", "acc(j, h, 1)").replace("return silu(acc(j, h, v)) * acc(j + BN / 16, h, v);", "return acc(j, h, v) * acc(j + BN / 16, h, v);")'
  # no global stores: the activation computed, nothing written (staged rows, and gelu's from the fragment)
  # half the weight panels per block (the other half stale): what a two-block cluster sharing each weight
  # slab by TMA multicast could save at most in operand traffic
  [halfb]='s.replace("for (int own = 0; own < kOwn; ++own) {", "for (int own = (blockIdx.x & 1) * (kOwn / 2); own < ((blockIdx.x & 1) + 1) * (kOwn / 2); ++own) {").replace("return a_boxes * kRowBox.bytes() + kPanels * kWeightPanelBox.bytes();", "return a_boxes * kRowBox.bytes() + kPanels / 2 * kWeightPanelBox.bytes();")'
  # half the row boxes per block: the same for a cluster sharing each row slab (column tiles paired)
  [halfa]='s.replace("for (int box = 0; box < a_boxes; ++box)", "for (int box = 0; box < (a_boxes + 1) / 2; ++box)").replace("return a_boxes * kRowBox.bytes() + kPanels", "return (a_boxes + 1) / 2 * kRowBox.bytes() + kPanels")'
  [nostore]='s.replace("if (4 * i + read_row < rows) *reinterpret_cast", "if (4 * i + read_row < rows - (1 << 30)) *reinterpret_cast").replace("const bool lo = row < rows, hi = row + 8 < rows;", "const bool lo = row < rows - (1 << 30), hi = row + 8 < rows - (1 << 30);")'
)
export QUICK_VARIANTS=${QUICK_VARIANTS:-tma-wgmma-128x256-4stage-prefetch} FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
for probe in ${PROBES:-base noepi nomma noact nostore halfb halfa}; do
  probe_build "expert_$probe" "moe/expert_pipeline.cuh moe/tile_gemm_tma.cuh moe/epilogue.cuh" "${EDIT[$probe]}" || continue
  QUICK_SHAPES=8192/2048/2048/32/2,16384/2048/8192/8/1 timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -v attributes | grep prefetch | sed "s/^/$probe gelu /"
  QUICK_ACTIVATION=swiglu QUICK_SHAPES=4096/4096/14336/8/2,8192/2048/768/128/8 timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -v attributes | grep prefetch | sed "s/^/$probe swiglu /"
done
