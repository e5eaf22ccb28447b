#!/usr/bin/env bash
# llama.cpp b11434 with CUDA (sm_90), llama-bench + llama-batched-bench, from the trimmed
# source tarball carried as .gpupeer/llama.cpp-src.tar.xz (scripts/trim_llamacpp.py makes it).
#   bash bench/gpu_peer_build.sh start    # start the build in the background; returns at once
#   bash bench/gpu_peer_build.sh wait N   # wait up to N seconds for it; 0 when built
#   bash bench/gpu_peer_build.sh status   # built / failed / building / not started
# The build takes minutes (ggml-cuda's kernels), longer than is left of a device command
# after the other stages, so `start` runs it under setsid + nohup, detached from this
# command: it keeps compiling between device calls while the machine stays warm, and a later
# call's `wait` finds it done. Idempotent: `start` does nothing while a build runs or once
# one has finished (remove $PEER_DIR to build again). Runs at nice 19, so that stages
# measuring the host side meanwhile keep their CPU. Files under $PEER_DIR (default
# /tmp/llama.cpp-peer): src/, build/ (binaries in build/bin), build.log, build.pid, and the
# markers built (success) or failed (the exit status).
set -uo pipefail
cd "$(dirname "$0")/.."
PEER_DIR=${PEER_DIR:-/tmp/llama.cpp-peer}
TARBALL=${PEER_TARBALL:-$PWD/.gpupeer/llama.cpp-src.tar.xz}
JOBS=${PEER_JOBS:-16}
CUDA=${PEER_CUDA:-ON}  # OFF: the same build for the CPU (how it is checked off the device)
TARGETS=${PEER_TARGETS:-llama-batched-bench llama-bench}
BIN=$PEER_DIR/build/bin
mkdir -p "$PEER_DIR"

state() {
  if [ -f "$PEER_DIR/built" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-bench" ]; then
    echo built
  elif [ -f "$PEER_DIR/failed" ]; then
    echo failed
  elif [ -f "$PEER_DIR/build.pid" ] && kill -0 "$(cat "$PEER_DIR/build.pid")" 2>/dev/null; then
    echo building
  else
    echo "not started"
  fi
}

fail() { echo "FAILED: $*"; echo "$*" > "$PEER_DIR/failed"; exit 1; }

# the tools the build needs, checked before it is started (so the starting call says what
# is missing) and again in the build
preflight() {
  local nvcc
  command -v cmake >/dev/null || fail "cmake absent on this machine (needed >= 3.14)"
  command -v c++ >/dev/null || fail "no C++ compiler (c++) on this machine"
  [ -f "$TARBALL" ] || fail "no $TARBALL: run scripts/trim_llamacpp.py here and carry .gpupeer/"
  if [ "$CUDA" = ON ]; then
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | tail -1)
    [ -n "$nvcc" ] && [ -x "$nvcc" ] || fail "nvcc absent: no CUDA toolkit (looked on PATH and in /usr/local/cuda*/bin)"
    export CUDACXX=$nvcc PATH=$(dirname "$nvcc"):$PATH
    local root
    root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    ls "$root"/lib64/libcublas.so* "$root"/targets/*/lib/libcublas.so* \
      /usr/lib/*/libcublas.so* >/dev/null 2>&1 \
      || echo "warning: no libcublas.so next to $nvcc: ggml-cuda links CUDA::cublas, the configure may stop there"
  fi
}

# the build itself (the detached child runs this)
build() {
  local t0=$SECONDS
  echo "$$" > "$PEER_DIR/build.pid"
  preflight
  [ "$CUDA" = ON ] && echo "nvcc: $("$CUDACXX" --version | tail -1)"
  echo "cmake: $(cmake --version | head -1); CUDA: $CUDA; jobs: $JOBS"
  rm -rf "$PEER_DIR/src" && mkdir -p "$PEER_DIR/src"
  tar xJf "$TARBALL" -C "$PEER_DIR/src" || fail "cannot unpack $TARBALL"
  local tree=$PEER_DIR/src/llama.cpp flags
  mapfile -t flags < "$tree/slotserve-cmake-flags.txt" || fail "no flags file in the tarball"
  nice -n 19 cmake -S "$tree" -B "$PEER_DIR/build" -DGGML_CUDA="$CUDA" \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON "${flags[@]}" || fail "cmake configure: exit $?"
  # shellcheck disable=SC2086  # TARGETS is a list
  nice -n 19 cmake --build "$PEER_DIR/build" -j "$JOBS" --target $TARGETS \
    || fail "cmake build: exit $?"
  echo "built in $((SECONDS - t0)) s: $BIN"
  date -u +%FT%TZ > "$PEER_DIR/built"
}

case "${1:-status}" in
  start)
    s=$(state)
    if [ "$s" = built ] || [ "$s" = building ]; then
      echo "llama.cpp peer build: $s ($PEER_DIR)"; exit 0
    fi
    rm -f "$PEER_DIR/failed"
    preflight
    setsid nohup bash "$0" _build > "$PEER_DIR/build.log" 2>&1 < /dev/null &
    echo "$!" > "$PEER_DIR/build.pid"
    echo "llama.cpp peer build started in the background (pid $!, -j $JOBS, log $PEER_DIR/build.log)"
    ;;
  _build) build ;;
  wait)
    limit=${2:-600} t0=$SECONDS
    while [ "$(state)" = building ] && [ $((SECONDS - t0)) -lt "$limit" ]; do
      sleep 15
      echo "  building ($((SECONDS - t0)) s): $(grep -o '^\[ *[0-9]*%\]' "$PEER_DIR/build.log" | tail -1)"
    done
    s=$(state)
    echo "llama.cpp peer build: $s after waiting $((SECONDS - t0)) s"
    [ "$s" = built ] || { tail -20 "$PEER_DIR/build.log" 2>/dev/null; exit 1; }
    ;;
  status) state ;;
  *) echo "usage: $0 start | wait SECONDS | status"; exit 2 ;;
esac
