#!/usr/bin/env bash
# The GPU check: posttrain's learner (FSDP2 + NCCL, ~1.1B Llama built from its config,
# seq 2048 / 4096 / 8192, with and without gradient checkpointing: step time, tokens/s, MFU
# over the datasheet and the measured bf16 matmul peak),
# the HF engine's tokens/s, the CUDA-IPC weight hand-off vs a device-to-device copy, and
# `pytest -m gpu`; one table at the end. About 3-5 minutes on one H200 (budget: < 8).
#
# Needs only: python with torch (a CUDA build), transformers, peft, pytest. posttrain is
# imported from this checkout (no install; pydantic, Ray, vLLM and FastAPI are not
# needed), nothing is downloaded. Without CUDA it prints that the device rows are
# skipped, runs the test files (their gpu tests skip) and exits 0.
#   PYTHON: the interpreter (default: .venv/bin/python if present, else python3).
#   Extra arguments go to scripts/gpu_check.py (e.g. --steps 5).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
