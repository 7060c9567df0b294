#!/usr/bin/env bash
# What bounds a large batch's gate phase (docs/perf-notes.md, "The gate phase taken apart"): the kernel
# built from copies of csrc/ with one part of the router GEMM thinned, each timed by scripts/quick_time.py
# on large-T shapes; the gate column is the phase to read (routing, and so every later phase, is
# meaningless in the probes). A block's first `STAGES` K slabs of every tile still load, so that no stage
# holds uninitialised shared memory.
#   norouter: the router box loaded only for those slabs (later slabs reuse a stage's stale router rows)
#   nox:      the token box of x likewise
#   nomma:    no tensor-core work (logits all 0: every token ties and takes experts 0..k-1)
# On a GPU machine: PROBES="base norouter nox nomma" bash scripts/gate_phase_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
FIRST='kt - k_begin < STAGES'
declare -A EDIT=(
  [base]='s'
  [norouter]='s.replace("kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));", "kGateTokenBox.bytes() + (FIRST ? gate_router_box_bytes(p.experts) : 0));").replace("      tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);", "      if (FIRST) tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);")'
  [nox]='s.replace("kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));", "(FIRST ? kGateTokenBox.bytes() : 0) + gate_router_box_bytes(p.experts));").replace("      tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);", "      if (FIRST) tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);")'
  [nomma]='s.replace("        if (has_experts)\n          gemm.mma_stage(", "        if (has_experts && p.tokens < 0)\n          gemm.mma_stage(")'
)
export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
for probe in ${PROBES:-base norouter nox nomma}; do
  probe_build "gate_$probe" "moe/gate.cuh" "${EDIT[$probe]//FIRST/$FIRST}" || continue
  QUICK_SHAPES=${GATE_PROBE_SHAPES:-8192/2048/2048/32/2,16384/2048/2048/64/2,16384/4096/1024/128/2,8192/2048/768/128/8/swiglu} \
    QUICK_VARIANTS=auto QUICK_GATE_SPLIT=auto timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -E "phases|Error|error" | sed "s/^/$probe /"
done
