"""The built-in real model (slow: converts the GGUF and runs the quickstart briefly)."""

from __future__ import annotations

import json

import pytest

from posttrain.common.model_registry import resolve_model_path
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_alias_converts_once_to_a_plain_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    folder = resolve_model_path("smollm2-135m-instruct")
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    mtime = (folder / "model.safetensors").stat().st_mtime
    assert resolve_model_path("smollm2-135m-instruct") == folder
    assert (folder / "model.safetensors").stat().st_mtime == mtime  # reused, not redone


def test_quickstart_two_steps(tmp_path):
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml", ["train.steps=2", "monitor.progress=false"]
    )
    history = run(recipe, tmp_path / "run")
    assert [h["policy_version"] for h in history] == [1, 2]
    assert all(h["failed_scores"] == 0 for h in history)
    # the quickstart trips none of its own advisories (it raised `truncated` at every step
    # when 38-75% of its responses ran to max_new_tokens 24)
    assert [h["advisories"] for h in history] == [[], []]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
