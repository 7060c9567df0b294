#!/usr/bin/env bash
# The full device check of record: build, the multi-process (MPS) tests in their own pytest process
# first, every other GPU test, the fused/emulated tests again on $OTHER_VARIANTS, the Ray GPU tests, a
# variant sweep ($QUICK_VARIANTS), and both benchmarks (SKIP_TESTS=1 / SKIP_BENCH=1 leave parts out). Logs in $OUT. Usage: bash scripts/h200_full.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$OUT/gpu.txt"
step() { echo "== $1 ($(date -u +%T))"; }
step build
python3 -m flashdmoe build --verbose > "$OUT/build.log" 2>&1; echo "build rc=$?"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | tee -a "$OUT/gpu.txt"
PYTEST="python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=5"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  step "multi-process tests (MPS)"
  timeout ${MP_TIMEOUT:-300} $PYTEST tests/test_ep_multiprocess.py > "$OUT/pytest_mp.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/pytest_mp.log"
  step "gpu tests"
  timeout 300 $PYTEST ${GPU_TESTS:-tests/test_fused_gpu.py tests/test_ep_emulated_gpu.py tests/test_ep_exchange.py tests/test_team.py tests/test_reference.py tests/test_bench.py} > "$OUT/pytest.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/pytest.log"
fi
for variant in ${OTHER_VARIANTS:-}; do
  step "gpu tests on $variant"
  FLASHDMOE_EXPERT_VARIANT=$variant timeout 200 $PYTEST -x tests/test_fused_gpu.py tests/test_ep_emulated_gpu.py > "$OUT/pytest_$variant.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/pytest_$variant.log"
done
if [ "${SKIP_TESTS:-0}" != "1" ] && [ "${RAY_TESTS:-1}" = "1" ]; then
  step "ray gpu tests"
  timeout 300 $PYTEST tests/test_ray.py > "$OUT/pytest_ray.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/pytest_ray.log"
fi
if [ -n "${EXTRA:-}" ]; then step extra; eval "$EXTRA" 2>&1 | tee "$OUT/extra.log"; fi
if [ "${SKIP_QUICK:-0}" != "1" ]; then step "variant sweep"; timeout 200 python3 scripts/quick_time.py > "$OUT/quick_time.log" 2>&1; grep -v Warn "$OUT/quick_time.log" | grep -E "^ *(tma|wgmma|mma)" | cut -c1-150; fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  step "bench single-gpu"; timeout 300 python3 -m flashdmoe bench --suite single-gpu --output "$OUT/bench" > "$OUT/bench.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/bench.log"
  step "bench expert-parallel"; timeout 300 python3 -m flashdmoe bench --suite expert-parallel --output "$OUT/bench_ep" > "$OUT/bench_ep.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/bench_ep.log"
fi
step done
