"""A new user's files, read exactly or refused by name (issue: a fresh user's bad-input
trial): recipes that are not UTF-8 or give a key twice, `~` in data paths, a NaN
answer, a python reward whose function is missing or does not parse, run names that
are not folder names, another algorithm's block, and `status` on a file."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from posttrain.config import RecipeError
from posttrain.config.data import DataConfig
from posttrain.config.rewards import PythonReward
from posttrain.recipes.cli import app
from posttrain.recipes.data import load_prompts
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.preflight import check_reward_runtime
from tests.conftest import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart_grpo.yaml"


def test_a_recipe_that_is_not_utf8_names_its_line(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes(QUICKSTART.read_bytes() + 'system_prompt: "Réponds."\n'.encode("latin-1"))
    lines = f.read_bytes().count(b"\n")
    with pytest.raises(RecipeError, match=f"latin1.yaml: not UTF-8 text .* at line {lines}"):
        load_recipe(f)


def test_a_key_given_twice_is_refused_not_overwritten(tmp_path):
    f = tmp_path / "twice.yaml"
    f.write_text(QUICKSTART.read_text() + "train: {steps: 5}\n")
    with pytest.raises(RecipeError, match=r"twice.yaml: .*key 'train' is given twice \(lines"):
        load_recipe(f)
    with pytest.raises(RecipeError, match="key 'steps' is given twice"):
        load_recipe(QUICKSTART, ["train={steps: 1, steps: 2}"])


def test_a_home_relative_data_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ok.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    r = load_recipe(QUICKSTART, ["data.train={path: ~/ok.jsonl}"])
    assert r.data.train.path == str(tmp_path / "ok.jsonl")


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_non_finite_answer_is_refused_by_row_and_key(tmp_path, value):
    # before: the ground truth became the text 'nan' and every sample scored 0
    f = tmp_path / "d.jsonl"
    f.write_text(f'{{"q": "2+2?", "a": "4"}}\n{{"q": "3+3?", "a": {value}}}\n')
    cfg = DataConfig.model_validate(
        {"train": {"path": str(f), "prompt_key": "q", "answer_key": "a"}}
    )
    with pytest.raises(RecipeError, match=r"d.jsonl:2: 'a' \(data.train.answer_key\) is"):
        load_prompts(cfg)


@pytest.mark.parametrize(
    ("source", "function", "needle"),
    [
        ("def score(x):\n    return 1.0\n", "badpy:nosuch", "defines no 'nosuch' at its top level"),
        ("def f(:\n    pass\n", "badpy:f", "badpy.py line 2 does not parse"),
    ],
)
def test_a_python_reward_is_checked_without_running_it(
    tmp_path, monkeypatch, source, function, needle
):
    (tmp_path / "badpy.py").write_text("raise SystemExit('validate ran user code')\n" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = PythonReward(name="x", type="python", function=function)
    with pytest.raises(RecipeError, match=f"rewards.2.function: .*{needle}"):
        check_reward_runtime(2, spec)
    if "score" in source:  # the same module's real function passes
        check_reward_runtime(2, PythonReward(name="x", type="python", function="badpy:score"))


@pytest.mark.parametrize("name", ["", "/tmp/abs", "../../etc/x", "a b", ".hidden"])
def test_a_run_name_must_be_a_folder_name(name):
    with pytest.raises(RecipeError, match="cannot name a run folder"):
        load_recipe(QUICKSTART, [f"name={name!r}"])


@pytest.mark.parametrize("block", ["dpo={beta: 0.3}", "ppo={gamma: 0.5}", "sft={max_length: 64}"])
def test_another_algorithms_block_is_refused(block):
    key = block.split("=")[0]
    with pytest.raises(RecipeError, match=f"{key}.* is set, but algorithm is grpo"):
        load_recipe(QUICKSTART, [block])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [  # grpo keys PPO and distillation never read: ignored without a word before
        (["algorithm=ppo", "grpo.kl_coef=0.1"], "grpo.kl_coef is set, but algorithm is ppo"),
        (["algorithm=ppo", "grpo.clip_eps=0.3"], "grpo.clip_eps is set, but algorithm is ppo"),
        (
            ["algorithm=distill", "distill.teacher=t", "grpo.scale_rewards=false"],
            "grpo.scale_rewards is set, but algorithm is distill",
        ),
    ],
)
def test_a_grpo_key_under_another_algorithm_is_refused(overrides, needle):
    with pytest.raises(RecipeError, match=needle):
        load_recipe(QUICKSTART, overrides)


def test_another_blocks_defaults_given_explicitly_pass():
    # the quickstart writes grpo's defaults out; trying PPO on it changes none of them
    r = load_recipe(QUICKSTART, ["algorithm=ppo", "ppo.epochs=1"])
    assert r.algorithm == "ppo"
    assert load_recipe(QUICKSTART, ["ppo={epochs: 1}"]).algorithm == "grpo"


def test_status_of_a_file_says_it_is_a_file():
    out = CliRunner().invoke(app, ["status", str(QUICKSTART)])
    assert out.exit_code == 2 and "is a file, not a folder" in out.output


def test_the_memory_line_names_a_frozen_part_only_when_there_is_one():
    from posttrain.learner.adapters import format_memory_report

    full = {"trainable_params": 10, "trainable_bytes": 40, "optimizer_bytes": 80}
    none = format_memory_report(
        {**full, "frozen_params": 0, "frozen_bytes": 0, "frozen_bytes_bf16": 0}
    )
    assert "frozen" not in none and "trainable 10 params" in none
    lora = {**full, "frozen_params": 5, "frozen_bytes": 2 << 20, "frozen_bytes_bf16": 1 << 20}
    assert "frozen 5 params 2.0 MiB (bf16 would be 1.0 MiB)" in format_memory_report(lora)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ({"engine": "tpu"}, "--engine tpu: not an engine; use one of vllm, hf"),
        ({"rewards": "- {name: x, type: bogus}\n"}, "rewards.yaml: 1 problem(s) in its list"),
    ],
)
def test_eval_options_errors_name_the_option_not_the_recipe(tmp_path, option, needle):
    from posttrain.recipes.assess.command import load_for
    from posttrain.recipes.assess.targets import Target

    if "rewards" in option:
        (tmp_path / "rewards.yaml").write_text(option["rewards"])
        option = {"rewards": tmp_path / "rewards.yaml"}
    target = Target("final", "runs/x/final", tmp_path, tmp_path, None)
    with pytest.raises(RecipeError) as e:
        load_for(target, QUICKSTART, [], **option)
    assert needle in str(e.value) and "quickstart_grpo.yaml" not in str(e.value)
