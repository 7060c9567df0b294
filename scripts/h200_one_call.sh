#!/usr/bin/env bash
# Everything of record in one device call (< 600 s), for sessions with little device time left: build,
# the fused tests on the default (and, with the emulated-team tests, on $TEST_VARIANTS), the variant sweep, the single-GPU benchmark on the
# default and on $BENCH_VARIANTS, every other GPU test (multi-process under MPS first, Ray last), and
# Nsight Compute on the expert-bound shape if time is left (SKIP_MP=1, SKIP_RAY=1, NCU=0 leave parts out). Each step has its own timeout; logs in $OUT
# (at most eight files come back). Usage: bash scripts/h200_one_call.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - start) )); }
step() { echo "== $1 ($(date -u +%T), $(left) s left)"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$OUT/gpu.txt"
step build
python3 -m flashdmoe build --verbose > /tmp/build.log 2>&1; echo "build rc=$?"
grep -E "registers|spill" /tmp/build.log | sort | uniq -c | tee -a "$OUT/gpu.txt"
PYTEST="python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=3"
TESTS_LOG="$OUT/pytest.log"
for variant in default ${TEST_VARIANTS:-}; do
  step "fused tests, $variant"
  if [ "$variant" = default ]; then unset FLASHDMOE_EXPERT_VARIANT; else export FLASHDMOE_EXPERT_VARIANT=$variant; fi
  echo "### fused tests, $variant" >> "$TESTS_LOG"
  # A non-default variant also runs the emulated teams (several ranks in one launch).
  files=tests/test_fused_gpu.py; [ "$variant" = default ] || files="$files tests/test_ep_emulated_gpu.py"
  timeout 120 $PYTEST $files >> "$TESTS_LOG" 2>&1; echo "rc=$?"; tail -1 "$TESTS_LOG"
done
unset FLASHDMOE_EXPERT_VARIANT
step sweep
QUICK_VARIANTS=${QUICK_VARIANTS:-} timeout 120 python3 scripts/quick_time.py 2>&1 | grep -vE "^kernel attributes" > "$OUT/quick.log"
grep -E "^ *(tma|wgmma|mma)" "$OUT/quick.log" | sed -E 's/ +host [0-9]+ us\/call//' | cut -c1-220
step "bench single-gpu (default variant)"
timeout 150 python3 -m flashdmoe bench --suite single-gpu --entries fused,grouped_mm --output "$OUT/bench" > /tmp/bench.log 2>&1
echo "rc=$?"; tail -13 /tmp/bench.log; rm -f "$OUT/bench/"*.json
for variant in ${BENCH_VARIANTS:-}; do
  step "bench single-gpu ($variant)"
  FLASHDMOE_EXPERT_VARIANT=$variant timeout 100 python3 -m flashdmoe bench --suite single-gpu --entries fused \
    --output /tmp/bench_$variant > /tmp/bench_$variant.log 2>&1; echo "rc=$?"; tail -7 /tmp/bench_$variant.log
done
step "gpu tests"
echo "### gpu tests" >> "$TESTS_LOG"
timeout $(( $(left) > 150 ? 120 : 60 )) $PYTEST tests/test_ep_emulated_gpu.py tests/test_ep_exchange.py tests/test_team.py \
  tests/test_reference.py tests/test_api.py >> "$TESTS_LOG" 2>&1; echo "rc=$?"; tail -1 "$TESTS_LOG"
if [ "$(left)" -gt 120 ] && [ "${SKIP_MP:-0}" != "1" ]; then
  step "multi-process tests (MPS)"
  echo "### multi-process tests" >> "$TESTS_LOG"
  timeout $(( $(left) - 60 > 200 ? 200 : $(left) - 60 )) $PYTEST tests/test_ep_multiprocess.py >> "$TESTS_LOG" 2>&1
  echo "rc=$?"; tail -1 "$TESTS_LOG"
fi
if [ "$(left)" -gt 90 ] && [ "${SKIP_RAY:-0}" != "1" ]; then
  step "ray gpu tests"
  echo "### ray gpu tests" >> "$TESTS_LOG"
  timeout $(( $(left) - 30 )) $PYTEST tests/test_ray.py >> "$TESTS_LOG" 2>&1; echo "rc=$?"; tail -1 "$TESTS_LOG"
fi
grep -E "^(FAILED|ERROR)" "$TESTS_LOG" | head -20
if [ "$(left)" -gt 70 ] && [ "${NCU:-1}" = "1" ]; then
  step ncu
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout $(( $(left) - 10 )) "$ncu" -k regex:moe_forward_kernel --launch-skip 1 --launch-count 1 --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --metrics sm__ops_path_tensor_src_bf16_dst_fp32.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second \
    python3 scripts/ncu_probe.py experts > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"; grep -E "Throughput|Frequency|Duration|L2|DRAM|per_second|ops_path|lts__" "$OUT/ncu.log" | head -30
fi
step done
