#!/usr/bin/env bash
# Host time per eager call (scripts/host_overhead.py) of another source tree against this one, on one
# machine, in alternation: the device's host CPU differs from one call to the next, so only times taken
# in the same run compare. HOST_AB_BASE=<tree>: a copy of the repository at another commit (for example
# `git archive <commit> | tar x -C ab_trees/<name>`, carried to the device); HOST_AB_ROUNDS (2).
# Each round also runs this tree's scripts/team_stack.py over each tree (a stack of team forwards: does the
# host wait between layers?), unless HOST_AB_TEAM_STACK=0; HOST_AB_TEAM_STACK_ARGS runs it once per
# ';'-separated set of its options instead (e.g. "--tokens 8;--train --tokens 8"). HOST_AB_OVERHEAD=0 skips
# scripts/host_overhead.py.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
base=$(cd "${HOST_AB_BASE:?HOST_AB_BASE=<tree>}" && pwd)
here=$PWD
site=/tmp/site
base_cache=/tmp/flashdmoe-cache-base
if ! (cd "$base" && export PYTHONPATH=$base:$site FLASHDMOE_CACHE_DIR=$base_cache &&
      timeout 240 python3 -m flashdmoe build && timeout 120 python3 -m flashdmoe build --host) > /tmp/host_ab_build.log 2>&1; then
  echo "the base tree did not build"; tail -20 /tmp/host_ab_build.log; exit 1
fi
for round in $(seq "${HOST_AB_ROUNDS:-2}"); do
  for side in base new; do
    if [ "$side" = base ]; then dir=$base cache=$base_cache; else dir=$here cache=$FLASHDMOE_CACHE_DIR; fi
    echo "== $side, round $round"
    if [ "${HOST_AB_OVERHEAD:-1}" != 0 ]; then
      (cd "$dir" && PYTHONPATH=$dir:$site FLASHDMOE_CACHE_DIR=$cache timeout 90 python3 scripts/host_overhead.py 2>&1 |
         grep -E "^T=|flashdmoe.moe|MoELayer|extension launch")
    fi
    if [ "${HOST_AB_TEAM_STACK:-1}" != 0 ]; then
      IFS=';' read -ra stacks <<< "${HOST_AB_TEAM_STACK_ARGS:-}"
      [ ${#stacks[@]} -eq 0 ] && stacks=("")
      for options in "${stacks[@]}"; do
        # shellcheck disable=SC2086 # each set is split into its options
        (cd "$dir" && PYTHONPATH=$dir:$site FLASHDMOE_CACHE_DIR=$cache timeout 90 python3 "$here/scripts/team_stack.py" \
           --tree "$dir" $options 2>&1 | tail -3)
      done
    fi
  done
done
