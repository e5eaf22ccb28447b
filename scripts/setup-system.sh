#!/usr/bin/env bash
# Install the system libraries slotserve uses: OpenBLAS (MLX's CPU wheel links the slow
# reference BLAS; slotserve preloads OpenBLAS instead). Without root or apt it warns and
# slotserve falls back to the reference BLAS (much slower, still correct).
set -u
if [ "$(uname -s)" != "Linux" ]; then exit 0; fi
if ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing libopenblas0-pthread (apt-get)"
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null \
    || echo "setup: WARNING: could not install libopenblas0-pthread; CPU matmuls will be slow"
else
  echo "setup: WARNING: OpenBLAS missing and cannot apt-get install it (need root);" \
       "run: sudo apt-get install libopenblas0-pthread"
fi
exit 0
