#!/usr/bin/env bash
# Device call for performance work: build (timed), the gate probe, the variant sweep with phase clock
# (QUICK_VARIANTS / QUICK_SHAPES), GPU tests (TESTS="files", once per variant in TEST_VARIANTS, default
# variant when empty), and optionally Nsight Compute on the paper shape (NCU=1).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u
t0=$(date +%s); python3 -m flashdmoe build --verbose > "$OUT/build.log" 2>&1; echo "build rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | head -12
if [ "${GATE_PROBE:-1}" = "1" ]; then
  echo "== gate probe"
  nvcc -std=c++17 -arch=sm_90a -O3 -I csrc -o /tmp/gate_probe scripts/gate_probe.cu && /tmp/gate_probe
fi
if [ -n "${TESTS:-}" ]; then
  for variant in ${TEST_VARIANTS:-default}; do
    echo "== gpu tests, variant $variant ($(date -u +%T))"
    [ "$variant" = default ] && unset FLASHDMOE_EXPERT_VARIANT || export FLASHDMOE_EXPERT_VARIANT=$variant
    timeout 300 python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=3 $TESTS > "$OUT/pytest_$variant.log" 2>&1
    echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/pytest_$variant.log" | head -20
  done
  unset FLASHDMOE_EXPERT_VARIANT
fi
echo "== sweep ($(date -u +%T))"
timeout 240 python3 scripts/quick_time.py 2>&1 | grep -vE "^kernel attributes" | tee "$OUT/quick.log" | grep -E "^ *(tma|wgmma|mma)|Error|error"
if [ "${NCU:-0}" = "1" ]; then
  echo "== ncu ($(date -u +%T))"
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  # Clocks as found (--clock-control none): under wgmma load the H200 runs below its base-locked clock.
  timeout 240 "$ncu" -k regex:moe_forward_kernel --launch-skip 1 --launch-count 1 --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --metrics sm__ops_path_tensor_src_bf16_dst_fp32.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum \
    python3 scripts/ncu_probe.py ${NCU_SHAPE:-paper} > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"; grep -E "Throughput|Busy|Stall|Issued|Pipe|pipe|L2|DRAM|Duration|Warp Cycles|Frequency|per_second|lts__|ERR" "$OUT/ncu.log" | head -50
fi
date -u
