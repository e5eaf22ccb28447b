#!/usr/bin/env bash
# Install the system packages slotserve uses:
# - OpenBLAS (MLX's CPU wheel links the slow reference BLAS; slotserve preloads OpenBLAS),
# - a C compiler with OpenMP (gcc) for slotserve's own CPU matmul kernel.
# Without root or apt it warns; slotserve then falls back (slower, still correct).
set -u
if [ "$(uname -s)" != "Linux" ]; then exit 0; fi
need=""
ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || need="libopenblas0-pthread"
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || need="$need gcc libgomp1"
if [ -z "$need" ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing$need (apt-get)"
  apt-get update -qq >/dev/null 2>&1 || true
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null \
    || echo "setup: WARNING: could not install$need; CPU matmuls will be slower"
else
  echo "setup: WARNING: missing$need and cannot apt-get install (need root);" \
       "run: sudo apt-get install$need"
fi
exit 0
