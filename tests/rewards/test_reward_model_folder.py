"""A missing, truncated or broken reward-model folder is named, with what is wrong
with it, before anything starts: `serve-rewards` exits 2 (never a traceback with exit
1), a recipe's `reward_model` component fails its preflight, and the scorer itself
raises a ValueError naming the folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.config import RecipeError
from posttrain.config.rewards import RewardModelReward
from posttrain.recipes.preflight import check_reward_runtime
from posttrain.rewards.reward_model import RewardModelScorer
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def rm_folder(tiny_model, tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("rm_ok") / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(
        folder
    )
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(f: Path) -> None:
    f.write_bytes(b"\x00\x01not a safetensors file" * 100)


def _huge_header(f: Path) -> None:
    f.write_bytes((10**12).to_bytes(8, "little") + b"{}")


# name → (how to break a copy of the folder, words the error must hold)
BROKEN = {
    "missing": (lambda d: shutil.rmtree(d), ["does not exist"]),
    "a_file": (lambda d: (shutil.rmtree(d), d.write_text("x")), ["not a folder"]),
    "no_config": (lambda d: (d / "config.json").unlink(), ["config.json"]),
    "bad_config": (lambda d: (d / "config.json").write_text("{not json"), ["config.json", "JSON"]),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), ["no weights"]),
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors"), ["truncated"]),
    "garbage_weights": (lambda d: _garbage(d / "model.safetensors"), ["model.safetensors"]),
    "huge_header": (lambda d: _huge_header(d / "model.safetensors"), ["truncated"]),
    "no_tokenizer": (
        lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        ["tokenizer"],
    ),
    "bad_tokenizer": (lambda d: _truncate(d / "tokenizer.json"), ["tokenizer.json"]),
    "missing_shard": (
        lambda d: (
            (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors"),
            (d / "model.safetensors.index.json").write_text(
                '{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                '"b": "model-00002-of-00002.safetensors"}}'
            ),
        ),
        ["model-00002-of-00002.safetensors"],
    ),
}


@pytest.fixture(params=sorted(BROKEN))
def broken(request, rm_folder, tmp_path):
    folder = tmp_path / "rm"
    shutil.copytree(rm_folder, folder)
    breaker, words = BROKEN[request.param]
    breaker(folder)
    return folder, words


def test_serve_rewards_exits_2_naming_the_folder_and_the_problem(broken, tmp_path):
    folder, words = broken
    cfg = tmp_path / "rewards.yaml"
    cfg.write_text(f"rewards:\n  - {{name: rm, type: reward_model, path: '{folder}'}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", "serve-rewards", str(cfg)]
        + ["--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(folder) in proc.stderr and "rewards.0.path" in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_preflight_names_the_recipe_key_and_the_problem(broken):
    folder, words = broken
    spec = RewardModelReward(name="rm", type="reward_model", path=str(folder))
    with pytest.raises(RecipeError, match=r"rewards\.3\.path") as got:
        check_reward_runtime(3, spec)
    assert all(w in str(got.value) for w in words), got.value


def test_the_scorer_raises_a_value_error_naming_the_folder(broken):
    folder, words = broken
    spec = RewardModelReward(name="rm", type="reward_model", path=str(folder))
    with pytest.raises(ValueError) as got:
        RewardModelScorer(spec)
    assert str(folder) in str(got.value) and all(w in str(got.value) for w in words)


def test_a_good_folder_passes_every_check(rm_folder):
    from posttrain.common.model_folder import model_folder_problem

    assert model_folder_problem(rm_folder) is None
    check_reward_runtime(0, RewardModelReward(name="rm", type="reward_model", path=str(rm_folder)))


def test_the_runs_local_service_exits_2_with_one_line(rm_folder, tmp_path):
    folder = tmp_path / "rm"
    shutil.copytree(rm_folder, folder)
    _truncate(folder / "model.safetensors")
    comps = f'[{{"name": "rm", "type": "reward_model", "path": "{folder}"}}]'
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.rewards.service", "--components", comps]
        + ["--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "truncated" in proc.stderr and str(folder) in proc.stderr
