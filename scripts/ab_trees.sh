#!/usr/bin/env bash
# Source trees for forward_ab.sh's and backward_ab.sh's AB_BASE and AB_MORE: each argument's csrc/ into
# ab_trees/<name>/csrc. An argument is a revision (named after it), or NAME=REV:C1,C2,... for REV with
# those commits reverted (a change timed alone against the build that has all the others, whose Python
# the trees must match). Run where the git history is (the device's copy of the tree has none).
# ab_trees/ is ignored, never committed by mistake: the device call carries it (`carry: ["ab_trees", ".whl"]`).
#   bash scripts/ab_trees.sh no-rt=gpu-pending:0b0d963,a3822c3 no-pf=gpu-pending:654bb62
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -gt 0 ] || { echo "usage: $0 REV | NAME=REV:COMMIT,... ..." >&2; exit 2; }
for spec in "$@"; do
  if [[ $spec == *=* ]]; then
    name=${spec%%=*} rest=${spec#*=}
    rev=${rest%%:*} reverts=${rest#*:}
    [ "$reverts" != "$rest" ] || reverts=""
  else
    name=${spec//\//_} rev=$spec reverts=""
  fi
  dir=ab_trees/$name
  rm -rf "$dir" && mkdir -p "$dir"
  if [ -z "$reverts" ]; then
    git archive "$rev" csrc | tar -x -C "$dir"
  else
    work=$(mktemp -d)
    git worktree add -q --detach "$work" "$rev"
    git -C "$work" revert --no-commit ${reverts//,/ } >/dev/null
    cp -r "$work/csrc" "$dir/"
    git -C "$work" revert --abort
    git worktree remove --force "$work"
  fi
  echo "$dir/csrc ($(git rev-parse --short "$rev")${reverts:+ without $reverts})"
done
