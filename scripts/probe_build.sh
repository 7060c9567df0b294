# Sourced by the probe scripts (expert_phase_probe.sh, backward_probe.sh): the kernel built from a copy of
# csrc/ with one part changed, into its own build cache.
#
#   probe_build NAME "FILES" EDIT
#
# copies csrc/ to /tmp/probe_src_NAME, applies EDIT -- a Python expression over a file's text `s` (`re`
# imported) -- to each of FILES (paths under csrc/), which must change one of them unless EDIT is `s`,
# builds (build_tree below), and exports FLASHDMOE_SOURCE_DIR and FLASHDMOE_CACHE_DIR for the timing that
# follows. Returns non-zero, saying why, when the edit matched nothing or the build failed (log:
# /tmp/probe_NAME_build.log).
probe_build() {
  local name=$1 files=$2 edit=$3 src=/tmp/probe_src_$1
  rm -rf "$src" && cp -r csrc "$src"
  PROBE_EDIT=$edit python3 - $(for f in $files; do echo "$src/$f"; done) <<'PY' || { echo "$name: the edit failed"; return 1; }
import os, re, sys
edit = os.environ["PROBE_EDIT"]
changed = False
for path in sys.argv[1:]:
    s = open(path).read()
    t = eval(edit)
    changed |= t != s
    open(path, "w").write(t)
assert edit == "s" or changed, "the edit matched nothing"
PY
  build_tree "probe_$name" "$src"
}

# ab_builds BASE: for an A/B in one run (forward_ab.sh, backward_ab.sh), the source tree BASE built into
# /tmp/ab_base_cache, each further tree of AB_MORE ("name=path,name=path": e.g. one branch's csrc/ each)
# into /tmp/ab_<name>_cache (in subshells: their exports stay there), and the working tree's csrc/ into
# the default cache; FLASHDMOE_BUILD_JOBS defaults to 16. Non-zero, saying why, when a build failed.
# The sides to time, in order: ab_sides (base, AB_MORE's names, new); a side's environment for what it
# times: ab_env SIDE (prints the assignments, one per line).
ab_builds() {
  export FLASHDMOE_BUILD_JOBS=${FLASHDMOE_BUILD_JOBS:-16}
  ( build_tree ab_base "$1" ) || return 1
  local pair
  for pair in ${AB_MORE//,/ }; do
    ( build_tree "ab_${pair%%=*}" "${pair#*=}" ) || return 1
  done
  timeout 300 python3 -m flashdmoe build > /tmp/ab_new_build.log 2>&1 \
    || { echo "new build failed"; tail -20 /tmp/ab_new_build.log; return 1; }
}
ab_sides() {
  local pair
  echo base
  for pair in ${AB_MORE//,/ }; do echo "${pair%%=*}"; done
  echo new
}
ab_env() {
  local pair
  case $1 in
    new) ;;
    base) printf '%s\n' "FLASHDMOE_SOURCE_DIR=$AB_BASE" "FLASHDMOE_CACHE_DIR=/tmp/ab_base_cache" ;;
    *) for pair in ${AB_MORE//,/ }; do
         [ "${pair%%=*}" = "$1" ] && printf '%s\n' "FLASHDMOE_SOURCE_DIR=${pair#*=}" "FLASHDMOE_CACHE_DIR=/tmp/ab_$1_cache"
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
