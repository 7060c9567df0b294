#!/usr/bin/env bash
# A/B of the forward kernel in one run: the working tree's csrc/ ("new", the default build cache)
# against another source tree ("base": AB_BASE, e.g. an earlier commit's csrc/ from `git archive`), built
# into its own cache, timed in alternation by scripts/quick_time.py so that clock drift hits both alike.
#   AB_BASE=/path/to/csrc AB_SHAPES="decode" AB_ROUNDS=2 bash scripts/forward_ab.sh
# AB_MORE="name=path,..." times further trees beside them (scripts/probe_build.sh ab_builds).
# Prints quick_time's rows prefixed by side and round, then whether each shape's output and routing were
# bitwise the same in the two builds (quick_time's digests: same seed, same inputs).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/probe_build.sh"
: "${AB_BASE:?AB_BASE: the other source tree}"
ab_builds "$AB_BASE" || exit 1
rm -f /tmp/ab_rows.log
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in $(ab_sides); do
    mapfile -t env < <(ab_env $side)
    env "${env[@]}" QUICK_SHAPES="${AB_SHAPES:-decode}" QUICK_VARIANTS=${QUICK_VARIANTS:-auto} timeout 150 \
      python3 scripts/quick_time.py 2>&1 | grep -E "phases|digest|Error|error" | sed "s/^/$side r$round /" \
      | tee -a /tmp/ab_rows.log
  done
done
# "base r1 digest <variant> <shape> ...: <hash>": the hash per (side, what was run), one per round.
python3 - <<'PY'
import collections, re
seen = collections.defaultdict(set)
for line in open("/tmp/ab_rows.log"):
    m = re.match(r"(\S+) r\d+ digest \S+ (.*): (\w+)$", line.strip())
    if m:
        seen[m.group(2)].add((m.group(1), m.group(3)))
for what, pairs in seen.items():
    hashes = {side: {h for s, h in pairs if s == side} for side in sorted({s for s, _ in pairs})}
    same = len(set().union(*hashes.values())) == 1
    print(f"bitwise {'equal' if same else 'DIFFERENT'} across builds and rounds: {what} {dict(hashes)}")
PY
