"""What a bench's `--smoke` mode runs on: a tiny random model built in process and
recipe overrides that shrink any shipped recipe to a couple of tiny steps.

A smoke run proves the bench still runs end to end and prints its table (tests/bench/
runs every one); its numbers mean nothing. The model is tests/tiny_model.py's random
Llama (character tokenizer, chat template), written to a temporary folder removed when
the process exits; nothing is downloaded.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tiny_model
    sys.path.insert(0, str(ROOT))

SMOKE_HELP = "a few seconds on a tiny random model, one repeat: checks the bench runs, not speed"


def scratch(prefix: str = "bench-smoke-") -> Path:
    """A new temporary folder, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def tiny_model(vllm: bool = False, max_positions: int = 512) -> Path:
    """A tiny random Llama folder (2 layers), removed at exit. `vllm`: 128 wide (vLLM's CPU
    attention needs head_dim 32), else 32 wide."""
    from tests.tiny_model import build_tiny_model

    folder = scratch()
    return build_tiny_model(
        folder / "model", hidden=128 if vllm else 32, max_positions=max_positions
    )


def tiny_run(model: Path, engine: str = "hf") -> list[str]:
    """`--set` overrides that turn a shipped GRPO-style recipe into 2 tiny steps on
    `model`: 2 prompts x 2 samples of at most 4 tokens, one learner rank, one thread per
    worker, one reward-service worker, no eval. `engine` 'hf' starts in a second where
    vLLM takes tens of seconds. A bench's own overrides after these win."""
    return [
        f"model.path={model}",
        "model.dtype=float32",
        f"rollout.engine={engine}",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.warmup_steps=0",
        "resources.learner.gpus=1",
        "resources.threads_per_worker=1",
        "reward_service.workers=1",
        "eval=null",
    ]
