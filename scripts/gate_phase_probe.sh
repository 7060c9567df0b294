#!/usr/bin/env bash
# What bounds a large batch's gate phase (docs/perf-notes.md, "The gate phase taken apart"): the kernel
# built from copies of csrc/ with one part of the router GEMM thinned, each timed by scripts/quick_time.py
# on large-T shapes; the gate column is the phase to read (routing, and so every later phase, is
# meaningless in the probes). A block's first `STAGES` K slabs of every tile still load, so that no stage
# holds uninitialised shared memory.
#   norouter: the router box loaded only for those slabs (later slabs reuse a stage's stale router rows)
#   nox:      the token box of x likewise
#   nomma:    no tensor-core work (logits all 0: every token ties and takes experts 0..k-1)
#   nofeed:   all three at once: what is left is the stage ring's handshakes, the logits' stores to
#             shared memory and the tile's finish (softmax, top-k, counts)
#   poll:     the stage waits read the error word and the timer every 1024 tries instead of every 16
#             (every pipeline of the kernel, the experts' too)
#   stamps:   block 0's gate time by SM clock cycles, summed over its tiles (its phase clocks re-pointed):
#             the columns quick_time prints as gate / offsets / dispatch / experts then mean megacycles of
#             warp 0's waits for a filled stage / the rest of the router GEMM / the tile's finish (a split
#             tile: the partials' fence, arrival and, for the last block, their sum and the finish) / the
#             producer's waits for a released stage; the combine column means nothing
#   finishparts: block 0's tile finishes by SM clock cycles, summed over its tiles: gate / offsets /
#             dispatch mean megacycles of thread 0 in the softmax and top-k of its rows / waiting for
#             the other warps' rows / the counts and ranks (masks, stores)
#   inline:   the softmax and top-k inlined into each caller instead of one out-of-line copy per group size
# On a GPU machine: PROBES="base norouter nox nomma nofeed poll stamps finishparts inline" bash scripts/gate_phase_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
FIRST='kt - k_begin < STAGES'
# Block 0's cycle counters (stamps, finishparts): declared, zeroed with the gate's pipeline, and
# written over the phase clocks, whose own stamps after the gate are dropped.
PROBE_ACC='s.replace("namespace flashdmoe {\n\ntemplate <typename Element, int STAGES>\nusing GateGemm", "namespace flashdmoe {\n__shared__ unsigned long long probe_acc[4];\ntemplate <typename Element, int STAGES>\nusing GateGemm").replace("    if (threadIdx.x == 0) pipe.init(kThreads / 32);  // released by every worker warp\n", "    if (threadIdx.x == 0) {\n      pipe.init(kThreads / 32);\n      for (int i = 0; i < 4; ++i) probe_acc[i] = 0;\n    }\n").replace("  stamp_phase(p, 1);\n", "").replace("    stamp_phase(p, 2);\n", "").replace("  stamp_phase(p, 3);\n", "").replace("  stamp_phase(p, 4);\n", "")'
FINISH_PARTS='.replace("  if (tile_tokens > kThreads / 32)\n", "  const long long probe_f0 = clock64();\n  if (tile_tokens > kThreads / 32)\n").replace("    softmax_topk_rows<32>(out, logits, stride, first_token, tile_tokens, choice, weight);\n  sync_workers();\n", "    softmax_topk_rows<32>(out, logits, stride, first_token, tile_tokens, choice, weight);\n  const long long probe_fs = clock64();\n  sync_workers();\n  const long long probe_f1 = clock64();\n").replace("  sync_workers();  // smem is reused by the next tile\n}\n", "  sync_workers();  // smem is reused by the next tile\n  if (threadIdx.x == 0) {\n    probe_acc[0] += probe_fs - probe_f0;\n    probe_acc[1] += probe_f1 - probe_fs;\n    probe_acc[2] += clock64() - probe_f1;\n  }\n}\n").replace("  return finished;\n}\n", "  if (block_in_rank(p) == 0 && threadIdx.x == 0) {\n    unsigned long long* c = p.phase_clock;\n    c[1] = c[0] + probe_acc[0];\n    c[2] = c[1] + probe_acc[1];\n    c[3] = c[2] + probe_acc[2];\n    c[4] = c[3] + 1;\n  }\n  return finished;\n}\n")'
declare -A EDIT=(
  [base]='s'
  [norouter]='s.replace("kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));", "kGateTokenBox.bytes() + (FIRST ? gate_router_box_bytes(p.experts) : 0));").replace("      tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);", "      if (FIRST) tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);")'
  [nox]='s.replace("kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));", "(FIRST ? kGateTokenBox.bytes() : 0) + gate_router_box_bytes(p.experts));").replace("      tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);", "      if (FIRST) tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);")'
  [nomma]='s.replace("        if (has_experts)\n          gemm.mma_stage(", "        if (has_experts && p.tokens < 0)\n          gemm.mma_stage(")'
  [nofeed]='s.replace("kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));", "(FIRST ? kGateTokenBox.bytes() + gate_router_box_bytes(p.experts) : 0));").replace("      tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);", "      if (FIRST) tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);").replace("      tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);", "      if (FIRST) tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);").replace("        if (has_experts)\n          gemm.mma_stage(", "        if (has_experts && p.tokens < 0)\n          gemm.mma_stage(")'
  [poll]='s.replace("    if ((spin & 15) == 0) {\n", "    if ((spin & 1023) == 0) {\n")'
  [finishparts]="$PROBE_ACC$FINISH_PARTS"
  [inline]='s.replace("static __device__ __noinline__ void softmax_topk_rows(", "__device__ __forceinline__ void softmax_topk_rows(")'
  [stamps]="$PROBE_ACC"'.replace("        feed.pipe->consumer_wait(feed.at, p);  // a failure is in the error word\n", "        const long long probe_w = clock64();\n        feed.pipe->consumer_wait(feed.at, p);\n        if (threadIdx.x == 0) probe_acc[0] += clock64() - probe_w;\n").replace("      if (!feed.pipe->producer_acquire(feed.at, p)) return false;\n", "      const long long probe_w = clock64();\n      if (!feed.pipe->producer_acquire(feed.at, p)) return false;\n      probe_acc[3] += clock64() - probe_w;\n").replace("  router_gemm<Element, STAGES, kTma>(p, tile, 0, gate_slabs<Element>(p), smem, layout, feed,\n", "  const long long probe_t0 = clock64();\n  router_gemm<Element, STAGES, kTma>(p, tile, 0, gate_slabs<Element>(p), smem, layout, feed,\n").replace("  finish_gate_tile<STAGES>(p, tile, smem);\n}\n", "  const long long probe_t1 = clock64();\n  finish_gate_tile<STAGES>(p, tile, smem);\n  if (threadIdx.x == 0) { probe_acc[1] += probe_t1 - probe_t0; probe_acc[2] += clock64() - probe_t1; }\n}\n").replace("  float* partial = p.gate_partial + static_cast<size_t>(item) * kGateTileM * E;\n", "  float* partial = p.gate_partial + static_cast<size_t>(item) * kGateTileM * E;\n  const long long probe_t0 = clock64();\n").replace("                                     });\n  // Every writer", "                                     });\n  if (threadIdx.x == 0) probe_acc[1] += clock64() - probe_t0;\n  const long long probe_t1 = clock64();\n  // Every writer").replace("  if (!last_to_arrive) return false;\n", "  if (!last_to_arrive) {\n    if (threadIdx.x == 0) probe_acc[2] += clock64() - probe_t1;\n    return false;\n  }\n").replace("  finish_gate_tile<STAGES>(p, tile, smem);\n  return true;\n", "  finish_gate_tile<STAGES>(p, tile, smem);\n  if (threadIdx.x == 0) probe_acc[2] += clock64() - probe_t1;\n  return true;\n").replace("  return finished;\n}\n", "  if (block_in_rank(p) == 0 && threadIdx.x == 0) {\n    unsigned long long* c = p.phase_clock;\n    c[1] = c[0] + probe_acc[0];\n    c[2] = c[1] + probe_acc[1] - probe_acc[0];\n    c[3] = c[2] + probe_acc[2];\n    c[4] = c[3] + probe_acc[3] + 1;\n  }\n  return finished;\n}\n")'
)
export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
for probe in ${PROBES:-base norouter nox nomma nofeed poll stamps finishparts inline}; do
  probe_build "gate_$probe" "moe/gate.cuh moe/moe_forward.cuh common/pipeline.cuh" "${EDIT[$probe]//FIRST/$FIRST}" || continue
  QUICK_SHAPES=${GATE_PROBE_SHAPES:-8192/2048/2048/32/2,16384/2048/2048/64/2,16384/4096/1024/128/2,8192/2048/768/128/8/swiglu} \
    QUICK_VARIANTS=auto QUICK_GATE_SPLIT=auto timeout 150 python3 scripts/quick_time.py 2>&1 \
    | grep -E "phases|Error|error" | sed "s/^/$probe /"
done
