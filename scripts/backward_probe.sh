#!/usr/bin/env bash
# Where the fused backward's g tiles spend their time (docs/perf-notes.md, "Backward"): the kernel built
# from copies of csrc/ with one part of the g tiles changed or removed, each launch timed by
# scripts/backward_phases.py. Results are meaningless where parts are missing; only the times are.
# On a GPU machine:
#   PROBES="base noepi nog" bash scripts/backward_probe.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
# Each probe: a Python expression over a file's text s (probe_build.sh).
declare -A EDIT=(
  [base]='s'
  # no g epilogue (the tiles still count as done)
  [noepi]='re.sub(r"\n( +)(g_epilogue<Element, \w+>\(p, gemm)", r"\n\1if (p.tokens < 0) \2", s)'
  # no g tiles: counts, gather and the two grid barriers alone
  [nog]='s.replace("c.g_tasks = row_tiles * c.g_cols;", "c.g_tasks = 0;")'
)
export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
shapes=${PROBE_SHAPES:-8192/2048/2048/32/2/gelu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu}
summary=()
for probe in ${PROBES:-base noepi nog}; do
  probe_build "backward_$probe" "backward/fused_backward.cuh backward/fused_params.cuh" "${EDIT[$probe]}" || continue
  kinds=g,all; [ "$probe" = nog ] && kinds=g; [ "$probe" = base ] && kinds=g,g+dx,g+dW2,g+dW1,all
  timeout ${PHASES_TIMEOUT:-120} python3 scripts/backward_phases.py --shapes "$shapes" --kinds "$kinds" > "/tmp/phases_$probe.log" 2>&1
  rc=$?; echo "$probe: rc=$rc"; [ $rc -eq 0 ] || tail -5 "/tmp/phases_$probe.log"
  while IFS= read -r line; do summary+=("$probe $line"); done < <(sed -n '/== summary/,$p' "/tmp/phases_$probe.log" | grep -v "== summary" | grep -v "^$")
done
echo; echo "== probe summary"; printf '%s\n' "${summary[@]}"
