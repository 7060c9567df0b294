# Sourced by the probe scripts (expert_phase_probe.sh, backward_probe.sh): the kernel built from a copy of
# csrc/ with one part changed, into its own build cache.
#
#   probe_build NAME "FILES" EDIT
#
# copies csrc/ to /tmp/probe_src_NAME, applies EDIT -- a Python expression over a file's text `s` (`re`
# imported) -- to each of FILES (paths under csrc/), builds (build_tree below), and exports
# FLASHDMOE_SOURCE_DIR and FLASHDMOE_CACHE_DIR for the timing that follows. Every `s.replace(old, ...)`
# and `re.sub(pattern, ...)` of EDIT must match in at least one of FILES: a probe whose text moved in the
# sources fails, naming what it did not find, instead of timing an unchanged kernel. Returns non-zero,
# saying why, when an edit did not match or the build failed (log: /tmp/probe_NAME_build.log).
# PROBE_CHECK_ONLY=1 applies the edits and stops there (no build, no GPU; non-zero so that the caller's
# timing is skipped): `PROBE_CHECK_ONLY=1 bash scripts/decode_probe.sh` checks every probe of a script.
probe_build() {
  local name=$1 files=$2 edit=$3 src=/tmp/probe_src_$1
  rm -rf "$src" && cp -r csrc "$src"
  PROBE_EDIT=$edit python3 - $(for f in $files; do echo "$src/$f"; done) <<'PY' || { echo "$name: the edit failed"; return 1; }
import os, re as _re, sys

found = {}  # each pattern of the edit: whether it matched in any file


class Text(str):
    def replace(self, old, new, count=-1):
        found[old] = found.get(old, False) or old in self
        return Text(str.replace(self, old, new, count))


class Re:
    def sub(self, pattern, repl, string, count=0, flags=0):
        out, n = _re.subn(pattern, repl, string, count=count, flags=flags)
        found[pattern] = found.get(pattern, False) or n > 0
        return Text(out)


edit, re = os.environ["PROBE_EDIT"], Re()
for path in sys.argv[1:]:
    s = Text(open(path).read())
    open(path, "w").write(eval(edit))
missing = [pattern for pattern, hit in found.items() if not hit]
assert not missing, "not found in " + " ".join(sys.argv[1:]) + ": " + "; ".join(map(repr, missing))
PY
  if [ -n "${PROBE_CHECK_ONLY:-}" ]; then echo "$name: every edit applies (not built: PROBE_CHECK_ONLY)"; return 1; fi
  build_tree "probe_$name" "$src"
}

# probe_patch NAME PATCH: a copy of csrc/ at /tmp/probe_src_NAME with PATCH applied, a unified diff of
# csrc/ (`git diff -- csrc` of the change: paths csrc/...), for a change too large for text edits; not
# built (the A/B scripts build it as one of their trees: AB_BASE or AB_MORE). Non-zero, saying why, when
# the patch does not apply; PROBE_CHECK_ONLY=1 reports that it applies and returns non-zero, as above.
probe_patch() {
  local name=$1 patch_file=$2 src=/tmp/probe_src_$1
  rm -rf "$src" && cp -r csrc "$src"
  patch --quiet --forward --batch -p2 -d "$src" < "$patch_file" || { echo "$name: the patch does not apply"; return 1; }
  if [ -n "${PROBE_CHECK_ONLY:-}" ]; then echo "$name: every edit applies (not built: PROBE_CHECK_ONLY)"; return 1; fi
}

# ab_builds BASE: for an A/B in one run (forward_ab.sh, backward_ab.sh), the source tree BASE built into
# /tmp/ab_base_cache, each further tree of AB_MORE ("name=path,name=path": e.g. one branch's csrc/ each)
# into /tmp/ab_<name>_cache (in subshells: their exports stay there), and the working tree's csrc/ into
# the default cache; FLASHDMOE_BUILD_JOBS defaults to 16. Non-zero, saying why, when a build failed.
# The sides to time, in order: ab_sides (base, AB_MORE's names, new); a side's environment for what it
# times: ab_env SIDE (prints the assignments, one per line).
# AB_MORE's "name=path" pairs, one per word; none where it is unset (the scripts run under set -u).
ab_more() { local more=${AB_MORE:-}; echo "${more//,/ }"; }
ab_builds() {
  export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
  ( build_tree ab_base "$1" ) || return 1
  local pair
  for pair in $(ab_more); do
    ( build_tree "ab_${pair%%=*}" "${pair#*=}" ) || return 1
  done
  timeout 300 python3 -m flashdmoe build > /tmp/ab_new_build.log 2>&1 \
    || { echo "new build failed"; tail -20 /tmp/ab_new_build.log; return 1; }
}
ab_sides() {
  local pair
  echo base
  for pair in $(ab_more); do echo "${pair%%=*}"; done
  echo new
}
ab_env() {
  local pair
  case $1 in
    new) ;;
    base) printf '%s\n' "FLASHDMOE_SOURCE_DIR=$AB_BASE" "FLASHDMOE_CACHE_DIR=/tmp/ab_base_cache" ;;
    *) for pair in $(ab_more); do
         if [ "${pair%%=*}" = "$1" ]; then
           printf '%s\n' "FLASHDMOE_SOURCE_DIR=${pair#*=}" "FLASHDMOE_CACHE_DIR=/tmp/ab_$1_cache"
         fi
       done ;;
  esac
}

# build_tree NAME SRC: the kernel built from the source tree SRC into its own cache (/tmp/NAME_cache), with
# FLASHDMOE_SOURCE_DIR and FLASHDMOE_CACHE_DIR exported for what runs next; non-zero, saying why, when the
# build failed (log: /tmp/NAME_build.log).
build_tree() {
  local name=$1 src=$2
  export FLASHDMOE_SOURCE_DIR=$src FLASHDMOE_CACHE_DIR=/tmp/${name}_cache
  timeout 300 python3 -m flashdmoe build --verbose > "/tmp/${name}_build.log" 2>&1 \
    || { echo "$name: build failed"; tail -20 "/tmp/${name}_build.log"; return 1; }
}
