#!/usr/bin/env bash
# Compact device call for the records: build, the Ray GPU tests, the variant sweep of the default
# variant, and both benchmarks (fused and grouped_mm only; emulated and MPS expert-parallel entries).
# Prints the tables; keeps few files under $OUT (the device returns at most 8).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
date -u; python3 -m flashdmoe build > /tmp/build.log 2>&1; echo "build rc=$?"
echo "== ray gpu tests ($(date -u +%T))"
timeout 200 python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=4 tests/test_ray.py ${RAY_K:+-k "$RAY_K"} > "$OUT/pytest_ray.log" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_ray.log" | head
echo "== sweep ($(date -u +%T))"
QUICK_VARIANTS=${QUICK_VARIANTS:-tma-wgmma-128x256-4stage-prefetch} timeout 120 python3 scripts/quick_time.py 2>&1 | grep -E "^ *(tma|wgmma|mma)"
echo "== bench single-gpu ($(date -u +%T))"
timeout 200 python3 -m flashdmoe bench --suite single-gpu --entries fused,grouped_mm --output "$OUT/bench" > /tmp/bench.log 2>&1
echo "rc=$?"; grep -E "^\|" "$OUT/bench/single-gpu.md" | head -16
echo "== bench expert-parallel ($(date -u +%T))"
timeout 240 python3 -m flashdmoe bench --suite expert-parallel --entries ${EP_ENTRIES:-emulated-1,emulated-2,emulated-4,emulated-8,mps-2,mps-4} --output "$OUT/bench_ep" > /tmp/bench_ep.log 2>&1
echo "rc=$?"; grep -E "^\||^- " "$OUT/bench_ep/expert-parallel.md" | head -30; tail -5 /tmp/bench_ep.log
rm -f "$OUT/bench/"*.json "$OUT/bench_ep/"*.json
date -u
