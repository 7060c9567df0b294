#!/usr/bin/env bash
# Everything of record on one H200 in one call (< 600 s): build (the kernel, then the host module), every GPU test (one process; then the
# multi-process tests under MPS; the NVSHMEM transport's; then Ray), the single-GPU and training benchmarks, the host-overhead
# script, optionally Nsight Compute. Each step has its own timeout; logs under $OUT (at most eight files
# come back), a summary table last. Skip steps with SKIP="standin mp nvshmem ray bench training host" (any subset);
# GPU_TESTS overrides the one-process test files, BENCH_CONFIGS the single-gpu bench shapes; NCU=1 adds Nsight Compute on the expert-bound shape; PROFILE=1 the backward's per-kernel profile
# (PROFILE_ARGS passes options to scripts/backward_profile.py); ONE_PROCESS_LIMIT the one-process tests' limit (300 s);
# PHASES=1 the fused backward's time per kind of task; SOAK=1 ~500 fused backward launches of the Mixtral
# shape under a hard limit (a hang beyond the watchdog shows as a timeout); PROBES="base noepi nog" the
# fused backward built with parts changed (scripts/backward_probe.sh); TEAMBENCH=1 an NVSHMEM team's training
# steps, the device-exchange backward beside the torch-ops one (scripts/team_backward_bench.py; TEAMBENCH_TRANSPORTS
# "p2p nvshmem" runs it once per peer transport, TEAMBENCH_ARGS adds its options, e.g. --device-only); EMUBENCH=1 an
# emulated team's training steps, the exchange backward beside the torch-ops one (scripts/emulated_backward_bench.py;
# EMUBENCH_ARGS adds its options, e.g. --graph --no-torch --ranks 4); NCU_SHAPES="<T/H/I/E/k/act> ..." the DRAM and L2
# bytes of one forward per shape (Nsight Compute, application replay, clocks left alone);
# BACKWARD_AB_BASE=<csrc tree> the fused backward launch against that tree's, in alternation (scripts/backward_ab.sh,
# where the working tree has it); FORWARD_AB_BASE=<csrc tree> the forward kernel against that tree's and AB_MORE's
# (scripts/forward_ab.sh: times in alternation, bitwise comparison of the outputs); QUICK_SHAPES=<T/H/I/E/k/act,...>
# scripts/quick_time.py on those shapes (kernel and phase times by the profiler and the kernel's clocks).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - start) )); }
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
summary=()
note() { summary+=("$1"); echo "== $1 ($(date -u +%T), $(left) s left)"; }
PYTEST="python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --durations=5"
# (the device's copy of the tree may carry a stale .git: the caller records the commit it sent)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; }

t0=$(date +%s)
python3 -m flashdmoe build --verbose > /tmp/build.log 2>&1; rc=$?
note "build rc=$rc in $(( $(date +%s) - t0 )) s"
grep -E "registers|spill" /tmp/build.log | sort | uniq -c
[ $rc -eq 0 ] || { tail -40 /tmp/build.log; exit 1; }
t0=$(date +%s)
python3 -m flashdmoe build --host > /tmp/host_build.log 2>&1; rc=$?
note "host module build rc=$rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { tail -40 /tmp/host_build.log; exit 1; }
if ! skip standin; then
  # the host path on CPU tensors with this machine's torch: the host module against the device's libtorch
  t0=$(date +%s)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_host_queue.py tests/test_status_checks.py \
    tests/test_host_path.py > /tmp/standin.log 2>&1; rc=$?
  note "host-path stand-in tests rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -1 /tmp/standin.log)"
fi

run_tests() {  # name, timeout, files...
  local name=$1 limit=$2; shift 2
  # A step that would outlast the call's budget is not started (it would be killed mid-run with the
  # steps after it and say nothing): the summary names it, to be run in a call of its own.
  if [ "$(left)" -lt "$limit" ]; then
    note "tests $name NOT RUN: needs up to $limit s, $(left) s left (run it in a call of its own)"
    return
  fi
  local t=$(date +%s)
  echo "### $name" >> "$OUT/pytest.log"
  timeout "$limit" $PYTEST "$@" >> "$OUT/pytest.log" 2>&1; local rc=$?
  note "tests $name rc=$rc in $(( $(date +%s) - t )) s: $(tail -1 "$OUT/pytest.log")"
}
run_tests one-process ${ONE_PROCESS_LIMIT:-300} ${GPU_TESTS:-tests/test_fused_gpu.py tests/test_ep_emulated_gpu.py tests/test_api.py \
  tests/test_team.py tests/test_reference.py tests/test_ep_exchange.py tests/test_expert_backward.py tests/test_ep_backward.py \
  $(ls tests/test_async_status*.py tests/test_custom_op.py tests/test_hf_integration.py tests/test_bench.py tests/test_bench_training.py \
       tests/test_training_gpu.py tests/test_training.py tests/test_weight_checks.py 2>/dev/null)}
skip mp || run_tests multi-process 200 tests/test_ep_multiprocess.py
skip nvshmem || run_tests nvshmem 240 tests/test_nvshmem_transport.py tests/test_ep_nvshmem_transport.py  # builds the NVSHMEM kernel itself (~45 s)
skip ray || run_tests ray 200 tests/test_ray.py tests/test_cli.py
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30

if ! skip host && [ "$(left)" -gt 40 ]; then
  # printed, not kept under $OUT: the files above use the eight that come back
  timeout 60 python3 scripts/host_overhead.py > /tmp/host.log 2>&1; note "host overhead rc=$?"; cat /tmp/host.log
fi
if ! skip training && [ "$(left)" -gt 130 ]; then
  # forward, backward and fwd+bwd through the public API beside grouped_mm under autograd (issue 14's shapes
  # and docs/design.md §12's); training.md, .json and .png land in $OUT/training
  t=$(date +%s)
  timeout 120 python3 -m flashdmoe bench --suite training --output "$OUT/training" > /tmp/training.log 2>&1
  note "bench training rc=$? in $(( $(date +%s) - t )) s"; tail -40 /tmp/training.log
fi
if ! skip bench && [ "$(left)" -gt 150 ]; then
  # the forward targets' 13 shapes (docs/design.md §12: design shapes in gelu, then swiglu model layers
  # and decode rows), the public call eager and replayed beside grouped_mm
  t=$(date +%s)
  timeout $(( $(left) - 10 )) python3 -m flashdmoe bench --suite single-gpu --configs "${BENCH_CONFIGS:-targets}" --entries fused,fused_graph,grouped_mm \
    --output /tmp/bench > /tmp/bench.log 2>&1
  note "bench single-gpu (targets) rc=$? in $(( $(date +%s) - t )) s"; tail -45 /tmp/bench.log
  cp /tmp/bench/single-gpu.md /tmp/bench/single-gpu.png /tmp/bench/single-gpu.json "$OUT/" 2>/dev/null
fi
if [ "${PROFILE:-0}" = "1" ] && [ "$(left)" -gt 70 ]; then
  # expert_backward's kernels one by one (element-wise back ends, saved pre-activations)
  timeout 60 python3 scripts/backward_profile.py ${PROFILE_ARGS:-} > /tmp/profile.log 2>&1; note "backward profile rc=$?"; cat /tmp/profile.log
  timeout 60 python3 scripts/training_host_profile.py > /tmp/host_profile.log 2>&1; note "training host profile rc=$?"
  cat /tmp/host_profile.log
fi
if [ "${PHASES:-0}" = "1" ] && [ "$(left)" -gt 70 ]; then
  # the fused backward's launch with each kind of task in turn, at each tile width, beside torch.mm
  timeout 120 python3 scripts/backward_phases.py > /tmp/phases.log 2>&1; note "backward phases rc=$?"
  grep -A20 "== summary" /tmp/phases.log || tail -20 /tmp/phases.log
fi
if [ "${SOAK:-0}" = "1" ] && [ "$(left)" -gt 140 ]; then
  timeout 120 python3 scripts/backward_phases.py --shapes 4096/4096/14336/8/2/swiglu --reps 100 > /tmp/soak.log 2>&1
  note "backward soak (Mixtral shape, ~500 launches) rc=$? (124: it hung)"; tail -3 /tmp/soak.log
fi
if [ -n "${PROBES:-}" ] && [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 20 )) bash scripts/backward_probe.sh > /tmp/probe.log 2>&1
  note "backward probes ($PROBES) rc=$?"; sed -n '/== probe summary/,$p' /tmp/probe.log | grep -v torch.mm
fi
if [ "${TEAMBENCH:-0}" = "1" ] && [ "$(left)" -gt 100 ]; then
  # TEAMBENCH_TRANSPORTS="p2p nvshmem": one run per peer transport (TEAMBENCH_ARGS e.g. --device-only)
  for transport in ${TEAMBENCH_TRANSPORTS:-p2p}; do
    timeout $(( $(left) - 20 )) python3 scripts/team_backward_bench.py --ranks "${TEAMBENCH_RANKS:-2,4}" \
      --peer-transport "$transport" ${TEAMBENCH_ARGS:-} --json "$OUT/team_backward_$transport.json" > /tmp/teamb.log 2>&1
    note "team backward bench ($transport) rc=$?"; grep -E "^\|" /tmp/teamb.log || tail -30 /tmp/teamb.log
  done
fi
if [ "${EMUBENCH:-0}" = "1" ] && [ "$(left)" -gt 40 ]; then
  timeout $(( $(left) - 20 )) python3 scripts/emulated_backward_bench.py ${EMUBENCH_ARGS:-} > /tmp/emubench.log 2>&1
  note "emulated team backward bench rc=$?"; grep -E "^\|" /tmp/emubench.log || tail -30 /tmp/emubench.log
fi
if [ -n "${BACKWARD_AB_BASE:-}" ] && [ -f scripts/backward_ab.sh ] && [ "$(left)" -gt 150 ]; then
  AB_BASE=$BACKWARD_AB_BASE timeout $(( $(left) - 20 )) bash scripts/backward_ab.sh > /tmp/backward_ab.log 2>&1
  note "backward A/B against $BACKWARD_AB_BASE rc=$?"; grep -E "^(base|new) " /tmp/backward_ab.log || tail -20 /tmp/backward_ab.log
fi
if [ -n "${FORWARD_AB_BASE:-}" ] && [ "$(left)" -gt 150 ]; then
  # AB_MORE (name=tree,...) adds sides; AB_SHAPES (default: the decode rows) and AB_ROUNDS pass through
  AB_BASE=$FORWARD_AB_BASE timeout $(( $(left) - 20 )) bash scripts/forward_ab.sh > /tmp/forward_ab.log 2>&1
  note "forward A/B against $FORWARD_AB_BASE${AB_MORE:+ and $AB_MORE} rc=$?"
  grep -E "phases|bitwise|failed" /tmp/forward_ab.log || tail -20 /tmp/forward_ab.log
fi
if [ -n "${QUICK_SHAPES:-}" ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 20 )) python3 scripts/quick_time.py > /tmp/quick.log 2>&1  # reads QUICK_SHAPES itself
  note "quick_time ($QUICK_SHAPES) rc=$?"; grep -E "phases|Error|error" /tmp/quick.log || tail -20 /tmp/quick.log
fi
if [ "${NCU:-0}" = "1" ] && [ "$(left)" -gt 70 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout $(( $(left) - 10 )) "$ncu" -k regex:moe_forward_kernel --launch-skip 1 --launch-count 1 --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis python3 scripts/ncu_probe.py experts > /tmp/ncu.log 2>&1
  note "ncu rc=$?"; grep -E "Throughput|Frequency|Duration|L2|DRAM" /tmp/ncu.log | head -20
fi
if [ -n "${NCU_SHAPES:-}" ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for shape in $NCU_SHAPES; do
    [ "$(left)" -gt 60 ] || break
    timeout 90 "$ncu" --replay-mode application --clock-control none --launch-skip 1 --launch-count 1 \
      -k regex:moe_forward_kernel --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
      python3 scripts/ncu_probe.py "$shape" > /tmp/ncu_shape.log 2>&1
    note "ncu DRAM bytes $shape rc=$?"; grep -E "dram__|lts__|gpu__time|rror" /tmp/ncu_shape.log | head -6
  done
fi
echo; echo "== summary"; printf '%s\n' "${summary[@]}"
