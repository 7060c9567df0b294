#!/usr/bin/env bash
# Where a decode forward's gate phase goes: the kernel built with its phase clocks re-pointed, each timed
# by scripts/quick_time.py on decode shapes. The phase columns quick_time prints then mean (ms):
#   gatestart: gate = block 0's start to the last block's start; offsets = the last block's start to the
#              last block done with its gate work; dispatch = that to block 0 past the gate barrier;
#              experts = offsets + dispatch + experts; combine = combine
#   gateparts: gate = block 0's start to the last split's router GEMM done; offsets = that to the tile's
#              partials summed (its last block); dispatch = that to the tile finished (softmax, top-k,
#              counts); experts = that to block 0 past the gate barrier; combine = the rest of the kernel
#   experts:   gate = block 0's start to its start of the expert phase (gate, offsets, dispatch); offsets =
#              that to the last GEMM1 tile done; dispatch = that to the last GEMM2 tile to find its row tile
#              done; experts = that to the last GEMM2 tile done; combine = the experts barrier and combine
# On a GPU machine: PROBES="gatestart gateparts experts" bash scripts/decode_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
AT='if (threadIdx.x == 0) atomicMax(p.phase_clock + N, ptx::global_timer_ns());'
declare -A EDIT=(
  [gatestart]='s.replace("  stamp_phase(p, 2);\n", "").replace("(p, rows_ordinal)) return;\n  stamp_phase(p, 3);\n", "(p, rows_ordinal)) return;\n").replace("  stamp_phase(p, 0);\n", "  stamp_phase(p, 0);\n  AT1\n").replace("  if (!grid_barrier(p, kPhaseGateDone, 1)) return;\n  stamp_phase(p, 1);\n", "  __syncthreads();\n  AT2\n  if (!grid_barrier(p, kPhaseGateDone, 1)) return;\n  stamp_phase(p, 3);\n")'
  [experts]='s.replace("  stamp_phase(p, 1);\n", "").replace("  stamp_phase(p, 2);\n", "").replace("  stamp_phase(p, 4);\n", "").replace("  stamp_phase(p, 3);\n", "  stamp_phase(p, 1);\n").replace("      ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);\n", "      ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);\n      AT2\n").replace("min(kTileN, p.hidden - col0));\n", "min(kTileN, p.hidden - col0));\n    AT4\n").replace("    tma::fence_proxy_async_global();\n    ring.hand_over(slot, ready ? task : kTaskAbort);\n", "    if (ready && job.gemm == FfnGemm::Gemm2) atomicMax(p.phase_clock + 3, ptx::global_timer_ns());\n    tma::fence_proxy_async_global();\n    ring.hand_over(slot, ready ? task : kTaskAbort);\n")'
  [gateparts]='s.replace("  stamp_phase(p, 2);\n", "").replace("(p, rows_ordinal)) return;\n  stamp_phase(p, 3);\n", "(p, rows_ordinal)) return;\n").replace("  stamp_phase(p, 4);\n", "").replace("kPhaseGateDone, 1)) return;\n  stamp_phase(p, 1);\n", "kPhaseGateDone, 1)) return;\n  stamp_phase(p, 4);\n").replace("                                     });\n  // Every writer", "                                     });\n  AT1\n  // Every writer").replace("gate_logits<STAGES>(smem), gate_logits_stride(E));\n  sync_workers();\n", "gate_logits<STAGES>(smem), gate_logits_stride(E));\n  sync_workers();\n  AT2\n").replace("  finish_gate_tile<STAGES>(p, tile, smem);\n  return true;\n}\n\n// The block", "  finish_gate_tile<STAGES>(p, tile, smem);\n  AT3\n  return true;\n}\n\n// The block")'
)
export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
for probe in ${PROBES:-gatestart gateparts experts}; do
  edit=${EDIT[$probe]}
  for n in 1 2 3 4; do edit=${edit//AT$n/${AT//N/$n}}; done
  probe_build "decode_$probe" "moe/moe_forward.cuh moe/gate.cuh moe/expert_pipeline.cuh" "$edit" || continue
  QUICK_SHAPES=1/2048/768/128/8/swiglu,8/2048/768/128/8/swiglu,1/4096/14336/8/2/swiglu QUICK_VARIANTS=auto \
    QUICK_GATE_SPLIT=${QUICK_GATE_SPLIT:-auto,off} timeout 120 python3 scripts/quick_time.py 2>&1 \
    | grep -E "phases" | sed "s/^/$probe /"
done
