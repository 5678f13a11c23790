"""Shared fixtures: a tiny random model folder, the repo root, the shared data folder, a
local Ray instance per test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Keep every test process to the cores it may use; never download anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of one CPU for the test module (modules that need other
    resources define their own)."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide random Llama with tied embeddings and a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_model_pad_eos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama whose pad token is its EOS `<|im_end|>` (id 3), as SmolLM2 ships
    (pad = eos = 2)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_pad_eos") / "model", pad_token="<|im_end|>"
    )


@pytest.fixture(scope="session")
def tiny_model_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama widened to head_dim 32 (vLLM's CPU attention needs it), with room
    for 1024 positions."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_vllm") / "model", hidden=128, max_positions=1024
    )


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present (tests and benchmarks only)")
    return SHARED_DATA


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.gpu` tests need a CUDA device: skipped where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
