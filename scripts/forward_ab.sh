#!/usr/bin/env bash
# A/B of the forward kernel in one run: the working tree's csrc/ ("new", the default build cache)
# against another source tree ("base": AB_BASE, e.g. an earlier commit's csrc/ from `git archive`), built
# into its own cache, timed in alternation by scripts/quick_time.py so that clock drift hits both alike.
#   AB_BASE=/path/to/csrc AB_SHAPES="decode" AB_ROUNDS=2 bash scripts/forward_ab.sh
# Prints quick_time's rows prefixed by side and round.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
: "${AB_BASE:?AB_BASE: the other source tree}"
ab_builds "$AB_BASE" || exit 1
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in base new; do
    mapfile -t env < <(ab_env $side)
    env "${env[@]}" QUICK_SHAPES="${AB_SHAPES:-decode}" QUICK_VARIANTS=${QUICK_VARIANTS:-auto} timeout 150 \
      python3 scripts/quick_time.py 2>&1 | grep -E "phases|Error|error" | sed "s/^/$side r$round /"
  done
done
