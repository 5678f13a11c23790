#!/usr/bin/env bash
# A venv with verifiers 0.4 for `rollout.environment: {type: verifiers, api: v1, python:
# ...}` (docs/multi-turn.md), layered on posttrain's .venv: verifiers 0.4.0 pins openai<3
# and mcp==2.0.0, which posttrain's venv does not have, so it goes into a venv of its own
# that sees .venv's packages (a .pth) and installs verifiers without its pins (its
# v1 code imports and runs with posttrain's openai 3 and mcp 2.3) plus the 16 small
# packages .venv lacks. posttrain's .venv is not changed.
#   scripts/vf1_venv.sh [DIR]     (default .venv-vf1); then
#   rollout.environment.python: DIR/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vf1}
BASE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$PY" -m venv "$DIR"
SITE=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$BASE" > "$SITE/zz_posttrain_venv.pth"
"$DIR/bin/pip" install -q --no-deps verifiers==0.4.0 aiofiles==25.1.0 connectrpc==0.11.1 \
  gepa==0.1.4 mcp-types==2.0.0 openai-harmony==0.0.8 prime-pydantic-config==0.4.3 \
  prime-runs==0.1.4 prime-sandboxes==0.5.1 prime-traces==0.0.10 prime-tunnel==0.1.15 \
  protobuf-py==0.1.1 protobuf-py-ext==0.1.1 renderers==0.1.12 tenacity==9.2.1 \
  tomli==2.5.0 tomli-w==1.2.0
"$DIR/bin/python" -c 'import verifiers.v1, openai; print("ok: verifiers.v1 with openai", openai.__version__)'
