#!/usr/bin/env bash
# One device call: build the extension, record the compiler's resource report and SASS evidence, run
# the GPU tests and the single-GPU benchmark. Logs land in $OUT (or ./h200-out). Usage:
#   bash scripts/h200_check.sh [pytest -k expression]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } | tee "$OUT/gpu.txt"

echo "== build"
t0=$(date +%s)
python3 -m flashdmoe build --verbose > "$OUT/build.log" 2>&1; rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"; tail -5 "$OUT/build.log"
grep -E "registers|spill|stack frame" "$OUT/build.log" | sort | uniq -c | head -20 | tee -a "$OUT/gpu.txt"
so=$(python3 -c "from flashdmoe import extension; print(extension.build())" 2>/dev/null | tail -1)
if [ -n "$so" ] && [ -f "$so" ]; then
  cuobjdump -sass "$so" > /tmp/sass.txt 2>/dev/null
  echo "SASS: HGMMA=$(grep -c HGMMA /tmp/sass.txt) HMMA=$(grep -c HMMA /tmp/sass.txt) LDL/STL=$(grep -cE 'LDL|STL' /tmp/sass.txt)" | tee -a "$OUT/gpu.txt"
fi

echo "== gpu tests"
python3 -m pytest -m gpu -q -rs --durations=8 -p no:cacheprovider ${1:+-k "$1"} ${GPU_TESTS:-tests/test_fused_gpu.py tests/test_reference.py tests/test_ray.py tests/test_bench.py} > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | head -30

if [ -n "${EXTRA:-}" ]; then echo "== extra"; eval "$EXTRA" 2>&1 | tee "$OUT/extra.log"; fi
echo "== quick timing"
[ "${SKIP_QUICK:-0}" = "1" ] || python3 scripts/quick_time.py 2>&1 | tee "$OUT/quick_time.log"

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  echo "== bench"
  python3 -m flashdmoe bench --suite single-gpu --output "$OUT/bench" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -30 "$OUT/bench.log"
fi
