# Sourced by the device-side scripts (h200_*.sh): log folder, package path, NVLink multicast off, the
# extension cache, and the wheels carried in .whl/ (ray, nvshmem4py, ...) installed into /tmp/site.
OUT=${OUT:-$PWD/h200-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FLASHDMOE_CACHE_DIR=${FLASHDMOE_CACHE_DIR:-/tmp/flashdmoe-cache}
# Ray's wheel is over the transfer limit: it travels as a tarball without its Java jars and libraries
# (rllib, serve, tune, train, data) that the project does not use.
# Unpacked and installed once per machine (the probe scripts source this file again); not for a check of
# the probes' edits alone (PROBE_CHECK_ONLY, scripts/probe_build.sh), which runs anywhere.
if [ -z "${PROBE_CHECK_ONLY:-}" ] && [ ! -e /tmp/site/.installed ]; then
  if ls .whl/ray-*.tar.xz >/dev/null 2>&1; then
    mkdir -p /tmp/site && tar xJf .whl/ray-*.tar.xz -C /tmp/site
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  [ -d /tmp/site ] && touch /tmp/site/.installed
fi
if [ -d /tmp/site ]; then
  export PATH=/tmp/site/bin:$PATH
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
fi
