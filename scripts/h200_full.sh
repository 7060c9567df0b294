#!/usr/bin/env bash
# The full device check of record: build, the gate routing check (scripts/gate_check.py: if the split
# gate, when turned on, misroutes where the unsplit one does not, everything after runs with it off),
# the multi-process (MPS) tests in their own pytest process first, every other GPU test, the fused tests
# with the split gate on, the fused/emulated tests again with $OTHER_VARIANTS as the default (e.g.
# mma.sync-128x128-3stage; the fused tests run every variant anyway), the Ray GPU tests, a
# variant sweep ($QUICK_VARIANTS), and the benchmarks (SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_EP_BENCH=1
# leave parts out). Logs in $OUT. Usage: bash scripts/h200_full.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$OUT/gpu.txt"
step() { echo "== $1 ($(date -u +%T))"; }
step build
python3 -m flashdmoe build --verbose > "$OUT/build.log" 2>&1; echo "build rc=$?"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | tee -a "$OUT/gpu.txt"; rm -f "$OUT/build.log"
step "gate routing check"
timeout 200 python3 scripts/gate_check.py 2>&1 | tee "$OUT/gate_check.log" | tail -22
check_rc=${PIPESTATUS[0]}; SPLIT_OK=1; if [ "$check_rc" = "1" ]; then echo "split gate misroutes: FLASHDMOE_GATE_SPLIT=0 from here on"; export FLASHDMOE_GATE_SPLIT=0; SPLIT_OK=0; fi
PYTEST="python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=5"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  step "multi-process tests (MPS)"
  timeout ${MP_TIMEOUT:-300} $PYTEST tests/test_ep_multiprocess.py > "$OUT/pytest_mp.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/pytest_mp.log"
  step "gpu tests"
  timeout 300 $PYTEST ${GPU_TESTS:-tests/test_fused_gpu.py tests/test_ep_emulated_gpu.py tests/test_ep_exchange.py tests/test_team.py tests/test_reference.py tests/test_bench.py tests/test_api.py} > "$OUT/pytest.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head; tail -4 "$OUT/pytest.log"
  step "fused tests, split gate on"
  [ "$SPLIT_OK" = 1 ] && FLASHDMOE_GATE_SPLIT=1 timeout 200 $PYTEST tests/test_fused_gpu.py > "$OUT/pytest_split.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_split.log" | head; tail -2 "$OUT/pytest_split.log"
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
if [ "${SKIP_QUICK:-0}" != "1" ]; then step "variant sweep"; timeout 200 python3 scripts/quick_time.py > "$OUT/quick_time.log" 2>&1; grep -v Warn "$OUT/quick_time.log" | grep -E "^ *(tma|wgmma|mma)" | cut -c1-230; fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  step "bench single-gpu"; timeout 300 python3 -m flashdmoe bench --suite single-gpu ${BENCH_ENTRIES:+--entries $BENCH_ENTRIES} --output "$OUT/bench" > "$OUT/bench.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/bench.log"
  [ "${SKIP_EP_BENCH:-0}" = "1" ] || { step "bench expert-parallel"; timeout 300 python3 -m flashdmoe bench --suite expert-parallel --output "$OUT/bench_ep" > "$OUT/bench_ep.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/bench_ep.log"; }
  rm -f "$OUT/bench/"*.json "$OUT/bench_ep/"*.json
fi
step done
