"""Recipe validation: shipped recipes pass; bad recipes fail fast with the key path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.preflight import check_runtime_inputs
from tests.conftest import ROOT

SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml"))


def test_recipes_are_found():
    assert {p.name for p in SHIPPED} >= {"quickstart_grpo.yaml", "grpo_gsm8k.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_validates(path, shared_data):
    recipe = load_recipe(path)
    check_runtime_inputs(recipe)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


BASE = (ROOT / "recipes" / "quickstart_grpo.yaml").read_text()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.bogus=1"], "train.bogus: unknown key"),
        (["train.steps=many"], "train.steps: Input should be a valid integer"),
        (["train.lr=-1"], "train.lr: Input should be greater than 0"),
        (["rollout.samples_per_prompt=1"], "set rollout.samples_per_prompt: 2 or more"),
        (["resources.rollout.gpus=3", "resources.rollout.gpus_per_engine=2"], "not divisible"),
        (["rewards.0.type=magic"], "rewards.0"),
        (["algorithm=sft"], "algorithm: Input should be 'grpo'"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", overrides)
    assert needle in str(e.value)
    assert "quickstart_grpo.yaml" in str(e.value)


def test_missing_section_and_yaml_errors(tmp_path):
    with pytest.raises(RecipeError, match="train: required key is missing"):
        load_recipe(_write(tmp_path, BASE.replace("train: {", "# train: {")))
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(_write(tmp_path, "name: [unclosed"))
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "absent.yaml")


def test_missing_data_file_and_model_folder(tmp_path):
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml",
                    ["data.train={path: nowhere.jsonl}"])
    with pytest.raises(RecipeError, match="data.train.path"):
        check_runtime_inputs(r)
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", [f"model.path={tmp_path}"])
    with pytest.raises(RecipeError, match="model.path"):
        check_runtime_inputs(r)


def test_schema_imports_no_torch():
    code = ("import sys, posttrain.recipes.loading as s; s.load_recipe('recipes/quickstart_grpo.yaml'); "
            "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.recipes.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_exit_codes():
    ok = _cli("validate", "recipes/quickstart_grpo.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = _cli("run", "recipes/quickstart_grpo.yaml", "--set", "rollout.samples_per_prompt=1")
    assert bad.returncode == 2
    assert "rollout.samples_per_prompt" in bad.stderr
    assert "Ray" not in bad.stdout + bad.stderr  # failed before anything started
    schema = _cli("schema")
    assert schema.returncode == 0 and '"Recipe"' in schema.stdout


def test_engine_defaults_to_vllm_where_installed(monkeypatch):
    import posttrain.config.recipe as schema

    path = ROOT / "recipes" / "grpo_code.yaml"  # sets engine: hf explicitly
    assert load_recipe(path).rollout.engine == "hf"
    for installed, want in ((True, "vllm"), (False, "hf")):
        monkeypatch.setattr(schema, "vllm_installed", lambda i=installed: i)
        r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout={}"])
        assert r.rollout.engine == want


def test_vllm_engine_checks_before_starting(monkeypatch, tiny_model, tiny_model_vllm, tmp_path):
    import posttrain.config.recipe as schema

    quick = ROOT / "recipes" / "quickstart_grpo.yaml"
    r = load_recipe(quick, [f"model.path={tiny_model}", "rollout.engine=vllm"])
    if schema.vllm_installed():  # the tiny test model's head_dim 8 is not a CPU kernel size
        with pytest.raises(RecipeError, match="head_dim 8; set rollout.engine: hf"):
            check_runtime_inputs(r)
        check_runtime_inputs(load_recipe(quick, [f"model.path={tiny_model_vllm}",
                                                 "rollout.engine=vllm"]))
    monkeypatch.setattr(schema, "vllm_installed", lambda: False)
    with pytest.raises(RecipeError, match="'vllm' is not installed here"):
        check_runtime_inputs(r)
    (tmp_path / "a_file").write_text("x")
    bad = load_recipe(quick, ["weight_sync.type=filesystem", "rollout.engine=hf",
                              f"weight_sync.directory={tmp_path / 'a_file' / 'w'}"])
    with pytest.raises(RecipeError, match="weight_sync.directory"):
        check_runtime_inputs(bad)
    with pytest.raises(RecipeError, match="weight_sync.type"):
        load_recipe(quick, ["weight_sync.type=carrier_pigeon"])


def test_one_stop_string_is_a_list_of_one():
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.stop='</s>'"])
    assert r.rollout.stop == ["</s>"]
    with pytest.raises(RecipeError, match="rollout.stop"):
        load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.stop=5"])
