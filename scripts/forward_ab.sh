#!/usr/bin/env bash
# A/B of the forward kernel in one run: the working tree's csrc/ ("new", the default build cache)
# against another source tree ("base": AB_BASE, e.g. an earlier commit's csrc/ from `git archive`), built
# into its own cache, timed in alternation by scripts/quick_time.py so that clock drift hits both alike.
#   AB_BASE=/path/to/csrc AB_SHAPES="decode" AB_ROUNDS=2 bash scripts/forward_ab.sh
# Prints quick_time's rows prefixed by side and round.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
base=${AB_BASE:?AB_BASE: the other source tree}
export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
( build_tree ab_base "$base" ) || exit 1  # a subshell: its exports stay there
timeout 300 python3 -m flashdmoe build > /tmp/ab_new_build.log 2>&1 || { echo "new build failed"; tail -20 /tmp/ab_new_build.log; exit 1; }
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in base new; do
    if [ $side = base ]; then env=(FLASHDMOE_SOURCE_DIR=$base FLASHDMOE_CACHE_DIR=/tmp/ab_base_cache); else env=(); fi
    env "${env[@]}" QUICK_SHAPES="${AB_SHAPES:-decode}" QUICK_VARIANTS=${QUICK_VARIANTS:-auto} timeout 150 \
      python3 scripts/quick_time.py 2>&1 | grep -E "phases|Error|error" | sed "s/^/$side r$round /"
  done
done
