#!/usr/bin/env bash
# Each named revision's csrc/ into ab_trees/<name>/csrc, for forward_ab.sh's and backward_ab.sh's AB_BASE
# and AB_MORE. Run where the git history is (the device's copy of the tree has none). ab_trees/ is ignored
# (never committed by mistake): the device call carries it (`carry: ["ab_trees", ".whl"]`).
#   bash scripts/ab_trees.sh main decode-round-trips decode-l2-prefetch
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -gt 0 ] || { echo "usage: $0 REVISION..." >&2; exit 2; }
for rev in "$@"; do
  dir=ab_trees/${rev//\//_}
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$rev" csrc | tar -x -C "$dir"
  echo "$dir/csrc ($(git rev-parse --short "$rev"))"
done
