#!/usr/bin/env bash
# slotserve's, the server's and the OpenAI SDK's wheels for the lent GPU machine, which has no
# package index: what slotserve needs beyond MLX's (.gpu2/, ../shared/tools/mlx-cuda-stage)
# and the device image (numpy, jinja2, httpx, tokenizers, ...), plus the `openai` client the
# agent load tests drive it with (loadtests/agents_gate.py, agent_turns.py). The versions are
# the ones this checkout's .venv runs, so the device serves with what the tests here passed.
#   scripts/stage_gpu_serve.sh          # writes .gpuserve/ (about 7 MB, git-ignored)
# On the device, carry ".gpuserve" beside ".gpu2"; bench/gpu.sh installs it first (every
# stage imports structlog).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
venv_py=${VENV_PY:-.venv/bin/python}
# slotserve's own runtime packages the image lacks (structlog, gguf, pydantic for openai),
# then the server's and the client's
packages=(structlog gguf pydantic pydantic_core annotated_types typing_inspection
          openai httpx2 httpcore2 truststore jiter sniffio distro anyio quart flask blinker
          itsdangerous hypercorn h2 hpack hyperframe priority wsproto llguidance)
pins=$("$venv_py" - "${packages[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:  # not a dependency of this openai/quart release
        pass
EOF
)
rm -rf .gpuserve && mkdir -p .gpuserve
# manylinux_2_31: llguidance's binary wheel (abi3); pip matches each platform tag exactly
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpuserve $pins
cat > .gpuserve/install.sh <<'EOF'
# source it on the device after .gpu2/install.sh: the server's wheels into /tmp/site-serve
if [ ! -d /tmp/site-serve/quart ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-serve .gpuserve/*.whl || return 1
fi
export PYTHONPATH="/tmp/site-serve:${PYTHONPATH:-}"
EOF
du -sh .gpuserve
echo "carry \".gpuserve\" beside \".gpu2\" in the device call that serves"
