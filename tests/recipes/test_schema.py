"""Recipe validation: shipped recipes pass; bad recipes fail fast with the key path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import RecipeError
from posttrain.recipes.data import load_prompts
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.preflight import check_lengths, check_runtime_inputs
from tests.conftest import ROOT
from tests.tiny_model import build_tiny_model

SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml"))


def test_recipes_are_found():
    assert {p.name for p in SHIPPED} >= {"quickstart_grpo.yaml", "grpo_gsm8k.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_validates(path, tiny_model):
    recipe = load_recipe(path)
    if any(c.type == "reward_model" for c in recipe.rewards):
        # ppo_hh_rm.yaml serves the folder rm_hh.yaml trains: it is missing, and named
        if not (Path(recipe.rewards[0].path) / "config.json").is_file():
            with pytest.raises(RecipeError, match="rewards.0.path.*reward_model"):
                check_runtime_inputs(recipe)
        recipe = recipe.model_copy(
            update={
                "rewards": [
                    c.model_copy(update={"path": str(tiny_model)})
                    if c.type == "reward_model"
                    else c
                    for c in recipe.rewards
                ]
            }
        )
    check_runtime_inputs(recipe)
    if recipe.facts.uses_rollouts:  # pairs and conversations are not prompts
        check_lengths(recipe, load_prompts(recipe.data))


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
        (["algorithm=kto"], "algorithm: Input should be 'grpo'"),
        (["grpo.estimator=ppo"], "grpo.estimator: Input should be 'grpo', 'rloo'"),
        (["grpo.loss=dpo"], "grpo.loss: Input should be 'ppo_clip', 'gspo'"),
        (["grpo.overlong_buffer=32"], "set grpo.overlong_buffer below 32"),
        (["grpo.overlong_buffer=0"], "grpo.overlong_buffer: Input should be greater than 0"),
        (["algorithm=ppo", "grpo.loss=gspo"], "grpo.loss is set, but algorithm is ppo"),
        (
            [
                "rollout.engine=vllm",
                "rollout.vllm.async_engine=true",
                "model.adapter.type=lora",
                "weight_sync.adapter_mode=adapter",
            ],
            "rollout.vllm.async_engine does not serve weight_sync.adapter_mode: adapter",
        ),
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
    with pytest.raises(RecipeError, match="is a folder, not a recipe file"):
        load_recipe(tmp_path)


def test_a_path_set_on_a_generator_block_says_how_to_replace_it():
    with pytest.raises(RecipeError, match=r"--set 'data.train=\{path: FILE.jsonl\}'"):
        load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["data.train.path=x.jsonl"])


def test_missing_data_file_and_model_folder(tmp_path):
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["data.train={path: nowhere.jsonl}"])
    with pytest.raises(RecipeError, match="data.train.path"):
        check_runtime_inputs(r)
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", [f"model.path={tmp_path}"])
    with pytest.raises(RecipeError, match="model.path"):
        check_runtime_inputs(r)


def test_schema_imports_no_torch():
    code = (
        "import sys, posttrain.recipes.loading as s; "
        "s.load_recipe('recipes/quickstart_grpo.yaml'); "
        "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
    import posttrain.config.rollout as schema

    path = ROOT / "recipes" / "ppo_gsm8k.yaml"  # sets engine: hf explicitly
    assert load_recipe(path).rollout.engine == "hf"
    for installed, want in ((True, "vllm"), (False, "hf")):
        monkeypatch.setattr(schema, "vllm_installed", lambda i=installed: i)
        r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout={}"])
        assert r.rollout.engine == want


def test_vllm_engine_checks_before_starting(monkeypatch, tiny_model, tiny_model_vllm, tmp_path):
    import posttrain.config.rollout as schema

    quick = ROOT / "recipes" / "quickstart_grpo.yaml"
    r = load_recipe(quick, [f"model.path={tiny_model}", "rollout.engine=vllm"])
    if schema.vllm_installed():  # the tiny test model's head_dim 8 is not a CPU kernel size
        with pytest.raises(RecipeError, match="head_dim 8; set rollout.engine: hf"):
            check_runtime_inputs(r)
        check_runtime_inputs(
            load_recipe(quick, [f"model.path={tiny_model_vllm}", "rollout.engine=vllm"])
        )
    monkeypatch.setattr(schema, "vllm_installed", lambda: False)
    with pytest.raises(RecipeError, match="'vllm' is not installed here"):
        check_runtime_inputs(r)
    (tmp_path / "a_file").write_text("x")
    bad = load_recipe(
        quick,
        [
            "weight_sync.type=filesystem",
            "rollout.engine=hf",
            f"weight_sync.directory={tmp_path / 'a_file' / 'w'}",
        ],
    )
    with pytest.raises(RecipeError, match="weight_sync.directory"):
        check_runtime_inputs(bad)
    with pytest.raises(RecipeError, match="weight_sync.type"):
        load_recipe(quick, ["weight_sync.type=carrier_pigeon"])


def test_one_stop_string_is_a_list_of_one():
    r = load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.stop='</s>'"])
    assert r.rollout.stop == ["</s>"]
    with pytest.raises(RecipeError, match="rollout.stop"):
        load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.stop=5"])


def test_empty_stop_string_exits_2():
    """`rollout.stop: [""]` used to validate, and then every HF sample ended after one
    token (every text contains '')."""
    bad = _cli("validate", "recipes/quickstart_grpo.yaml", "--set", "rollout.stop=['']")
    assert bad.returncode == 2, bad.stdout
    assert "rollout.stop: an empty stop string" in bad.stderr
    with pytest.raises(RecipeError, match="rollout.stop: an empty stop string"):
        load_recipe(ROOT / "recipes" / "quickstart_grpo.yaml", ["rollout.stop=''"])


def test_response_longer_than_vllm_max_model_len_exits_2():
    """`max_new_tokens: 32` with `max_model_len: 16` used to validate "ok"."""
    bad = _cli("validate", "recipes/quickstart_grpo.yaml", "--set", "rollout.vllm.max_model_len=16")
    assert bad.returncode == 2, bad.stdout
    assert "rollout.vllm.max_model_len (16)" in bad.stderr
    assert "rollout.max_new_tokens is 32" in bad.stderr
    # The limit is vLLM's: with engine hf, rollout.vllm is not used.
    load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        ["rollout.engine=hf", "rollout.vllm.max_model_len=16"],
    )


def test_response_longer_than_model_context_exits_2_before_ray(tmp_path):
    """`max_new_tokens: 100000` on a 2k-context model used to validate "ok" (and run)."""
    model = build_tiny_model(tmp_path / "model", max_positions=2048)
    args = [
        "recipes/quickstart_grpo.yaml",
        "--set",
        f"model.path={model}",
        "--set",
        "rollout.engine=hf",
        "--set",
        "rollout.max_new_tokens=100000",
    ]
    for command in ("validate", "run"):
        bad = _cli(command, *args)
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert "rollout.max_new_tokens:" in bad.stderr
        assert "more than the model's context, 2048 tokens" in bad.stderr
        assert "Ray" not in bad.stdout + bad.stderr  # failed before anything started
    ok = _cli("validate", *args[:-1], "rollout.max_new_tokens=1900")
    assert ok.returncode == 0, ok.stderr


# The tiny model's tokenizer has one token per character; the chat template adds
# "<|im_start|>user\n", "<|im_end|>\n" and "<|im_start|>assistant\n": 19 tokens, and
# a system message "<|im_start|>system\n...<|im_end|>\n": 10 tokens more than its text.
USER_TURN, SYSTEM_TURN = 19, 10


def _length_recipe(tmp_path: Path, model: Path, *overrides: str):
    data = tmp_path / "prompts.jsonl"
    rows = [{"question": "1+1", "answer": "2"}, {"question": "x" * 40, "answer": "0"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        [
            f"model.path={model}",
            f"data.train={{path: {data}}}",
            "model.system_prompt=null",
            *overrides,
        ],
    )
    return r, load_prompts(r.data)


def test_longest_prompt_plus_response_must_fit(tmp_path):
    """Exact boundaries: the longest prompt (row 1: 40 characters) after the chat template,
    with the system prompt when set, plus max_new_tokens against the model's context
    and against rollout.vllm.max_model_len."""
    model = build_tiny_model(tmp_path / "model", max_positions=128)
    longest = 40 + USER_TURN
    r, prompts = _length_recipe(
        tmp_path, model, "rollout.engine=hf", f"rollout.max_new_tokens={128 - longest}"
    )
    check_lengths(r, prompts)
    r, prompts = _length_recipe(
        tmp_path, model, "rollout.engine=hf", f"rollout.max_new_tokens={129 - longest}"
    )
    with pytest.raises(
        RecipeError,
        match=rf"rollout.max_new_tokens: data.train prompt 1 .* is "
        rf"{longest} tokens .* set rollout.max_new_tokens to {128 - longest} "
        "or less",
    ):
        check_lengths(r, prompts)
    system = "Be brief."
    r, prompts = _length_recipe(
        tmp_path,
        model,
        "rollout.engine=hf",
        f"rollout.max_new_tokens={128 - longest}",
        f"model.system_prompt='{system}'",
    )
    with pytest.raises(
        RecipeError,
        match=f"is {longest + len(system) + SYSTEM_TURN} tokens "
        "after the chat template with model.system_prompt",
    ):
        check_lengths(r, prompts)
    vllm = ["rollout.engine=vllm", "rollout.vllm.max_model_len=64"]
    r, prompts = _length_recipe(tmp_path, model, *vllm, f"rollout.max_new_tokens={64 - longest}")
    check_lengths(r, prompts)
    r, prompts = _length_recipe(tmp_path, model, *vllm, f"rollout.max_new_tokens={65 - longest}")
    with pytest.raises(
        RecipeError,
        match=r"rollout.vllm.max_model_len: .* more than "
        r"rollout.vllm.max_model_len \(64\)",
    ):
        check_lengths(r, prompts)
    r, prompts = _length_recipe(
        tmp_path, model, "rollout.engine=vllm", "rollout.vllm.max_model_len=256"
    )
    with pytest.raises(
        RecipeError, match="rollout.vllm.max_model_len: 256 is longer than the model's context"
    ):
        check_lengths(r, prompts)


def test_length_check_reads_converted_aliases_only(tmp_path, monkeypatch, tiny_model):
    """A built-in alias is read once converted; before that (converting takes a minute
    and torch) the context and prompt checks are skipped. DPO is not checked here."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    quick = ROOT / "recipes" / "quickstart_grpo.yaml"
    r = load_recipe(quick, ["rollout.max_new_tokens=100000"])
    prompts = load_prompts(r.data)
    check_lengths(r, prompts)  # not converted: skipped
    shutil.copytree(tiny_model, tmp_path / "cache" / "models" / "smollm2-135m-instruct")
    with pytest.raises(RecipeError, match="more than the model's context, 512 tokens"):
        check_lengths(r, prompts)
    dpo = load_recipe(ROOT / "recipes" / "dpo_hh.yaml", [f"model.path={tiny_model}"])
    check_lengths(dpo, prompts)  # DPO: dpo.max_length, not rollouts


def test_run_converts_the_alias_so_lengths_are_checked_before_ray(
    tmp_path, monkeypatch, tiny_model
):
    """A fresh user's first run: the alias is not converted yet. `validate` says the check
    waits; `run` converts first (here: a stand-in conversion) and refuses the length."""
    import posttrain.common.model_registry as registry

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    quick = ROOT / "recipes" / "quickstart_grpo.yaml"
    r = load_recipe(quick, ["rollout.max_new_tokens=100000"])
    prompts = load_prompts(r.data)
    assert check_lengths(r, prompts) is False  # validate: skipped, and it says so
    monkeypatch.setattr(registry, "resolve_model_path", lambda path: tiny_model)
    with pytest.raises(RecipeError, match="more than the model's context, 512 tokens"):
        check_lengths(r, prompts, convert=True)
    env = {**os.environ, "POSTTRAIN_CACHE": str(tmp_path / "cache2")}
    note = subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", "validate", str(quick)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert note.returncode == 0 and "prompt lengths not checked yet" in note.stderr


def test_more_mini_batches_than_rollouts_is_refused():
    quick = ROOT / "recipes" / "quickstart_grpo.yaml"
    r = load_recipe(quick)
    rows = r.train.prompts_per_step * r.rollout.samples_per_prompt
    load_recipe(quick, [f"grpo.mini_batches={rows}"])
    with pytest.raises(
        RecipeError, match=f"grpo.mini_batches is {rows + 1}, but a step has only {rows} rollouts"
    ):
        load_recipe(quick, [f"grpo.mini_batches={rows + 1}"])


def test_overlong_buffer_not_below_max_new_tokens_exits_2():
    bad = _cli("validate", "recipes/quickstart_grpo.yaml", "--set", "grpo.overlong_buffer=40")
    assert bad.returncode == 2, bad.stdout
    assert "grpo.overlong_buffer is 40, but rollout.max_new_tokens is 32" in bad.stderr
    ok = _cli(
        "validate",
        "recipes/quickstart_grpo.yaml",
        "--set",
        "grpo.estimator=rloo",
        "--set",
        "grpo.loss=gspo",
        "--set",
        "grpo.overlong_buffer=6",
        "--set",
        "grpo.mask_truncated=true",
    )
    assert ok.returncode == 0, ok.stderr


def test_async_engine_key_picks_the_asyncllm_engine():
    from posttrain.recipes.roles import engine_settings

    path = ROOT / "recipes" / "quickstart_grpo.yaml"
    on = load_recipe(path, ["rollout.engine=vllm", "rollout.vllm.async_engine=true"])
    off = load_recipe(path, ["rollout.engine=vllm"])
    assert engine_settings(on, "m").kind == "vllm_async"
    assert engine_settings(off, "m").kind == "vllm"
    with pytest.raises(RecipeError, match="rollout.engine is 'hf'"):  # not silently ignored
        load_recipe(path, ["rollout.engine=hf", "rollout.vllm.async_engine=true"])
