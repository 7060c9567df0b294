#!/usr/bin/env bash
# A/B of the fused backward launch in one run: the working tree's csrc/ ("new", the default build cache)
# against another source tree ("base": AB_BASE, e.g. main's csrc/ from `git archive`), built into its
# own cache, timed in alternation by scripts/backward_phases.py so that clock drift hits both alike.
#   AB_BASE=/path/to/csrc AB_KINDS=g,all AB_ROUNDS=2 bash scripts/backward_ab.sh
# Prints backward_phases' summary rows prefixed by side and round.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
: "${AB_BASE:?AB_BASE: the other source tree}"
ab_builds "$AB_BASE" || exit 1
shapes=${AB_SHAPES:-8192/2048/2048/32/2/gelu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu}
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in $(ab_sides); do
    mapfile -t env < <(ab_env $side)
    env "${env[@]}" timeout ${PHASES_TIMEOUT:-150} python3 scripts/backward_phases.py --shapes "$shapes" \
      --kinds "${AB_KINDS:-g,all}" > "/tmp/ab_${side}_r$round.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || { echo "$side r$round: rc=$rc"; tail -5 "/tmp/ab_${side}_r$round.log"; }
    sed -n '/== summary/,$p' "/tmp/ab_${side}_r$round.log" | grep -v "== summary" | grep -v "^$" | sed "s/^/$side r$round /"
  done
done
