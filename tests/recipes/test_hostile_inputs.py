"""Hostile values of the data and `eval:` keys are refused by the schema or by
`posttrain validate` (exit 2) before anything expensive starts, naming the key and the
fix: sizes no run can use, arithmetic that cannot be made or printed, errors of
`eval.prompts` files named by their own keys, chat generators as prompts, an
evaluation schedule that skips the trained policy, ground-truth advice per source."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml
from typer.testing import CliRunner

from posttrain.config import RecipeError
from posttrain.recipes.cli import app
from posttrain.recipes.loading import load_recipe

QUICKSTART = Path(__file__).parents[2] / "recipes" / "quickstart_grpo.yaml"


def _refused(overrides: list[str], recipe: Path = QUICKSTART) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, overrides)
    return str(e.value)


SIZES = {
    "arithmetic": (["data.train.size=1000000000"], "data.train.size: size is 1,000,000,000"),
    "eval arithmetic": (["eval.prompts.size=1000000000"], "eval.prompts.size: size is"),
    "tool_chats": (
        [
            "algorithm=sft",
            "rewards=[]",
            "eval=null",
            "data.train={generator: tool_chats, size: 1000000000}",
        ],
        "data.train.size: size is 1,000,000,000",
    ),
    "reasoning_gym": (
        ["data.train={reasoning_gym: leg_counting, size: 1000000000}"],
        "data.train.size: size is 1,000,000,000, more than the 1,000,000 problems "
        "reasoning_gym leg_counting",
    ),
    "mixture size": (
        ["data.train={mixture: [{generator: arithmetic, size: 10}], size: 1000000000}"],
        "data.train.size: size is 1,000,000,000, more than the 1,000,000 problems a mixture",
    ),
    "mixture entry": (
        ["eval.prompts={mixture: [{reasoning_gym: leg_counting, size: 2000000}]}"],
        "eval.prompts.mixture.0.size: size is 2,000,000",
    ),
    "mixture total": (
        [
            "data.train={mixture: [{generator: arithmetic, size: 900000}, "
            "{reasoning_gym: leg_counting, size: 900000}]}"
        ],
        "data.train: the mixture's generated sources make 1,800,000 problems together",
    ),
}


@pytest.mark.parametrize("case", sorted(SIZES))
def test_a_size_no_run_can_use_is_refused_naming_key_and_limit(case):
    overrides, needle = SIZES[case]
    got = _refused(overrides)
    assert needle in got and "held in memory" in got and "1,000,000 or less" in got, got


def test_the_largest_allowed_size_validates_without_generating():
    r = load_recipe(QUICKSTART, ["data.train.size=1000000"])
    assert r.data.train.size == 1_000_000


ARITHMETIC = {
    "digits": (["data.train.max_digits=1000000000"], "data.train.max_digits: Input should be"),
    "terms": (["data.train.max_terms=1000000000"], "data.train.max_terms: Input should be"),
    "division": (
        ["data.train.operators=['/']", "data.train.max_digits=8"],
        "max_digits is 8 with operator '/'",
    ),
    "product": (
        ["data.train.operators=['*']", "data.train.max_terms=100", "data.train.max_digits=100"],
        "max_terms × max_digits is 10000 with operator '*'",
    ),
    "size true": (["data.train.size=true"], "data.train.size: a boolean (true/false)"),
    "k true": (["eval.k=true"], "eval.k: a boolean (true/false) where a number"),
}


@pytest.mark.parametrize("case", sorted(ARITHMETIC))
def test_arithmetic_that_would_hang_or_crash_is_refused(case):
    overrides, needle = ARITHMETIC[case]
    assert needle in _refused(overrides)


def _recipe(tmp_path: Path, model: Path, **blocks) -> Path:
    tree = {
        "name": "hostile",
        "algorithm": "grpo",
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 20, "max_digits": 2}},
        "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
        "rewards": [{"name": "correct", "type": "math"}],
        "train": {"steps": 4, "prompts_per_step": 1},
        **blocks,
    }
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(tree))
    return f


def _validate(recipe: Path, *overrides: str):
    args = ["validate", str(recipe)] + [a for o in overrides for a in ("--set", o)]
    return CliRunner().invoke(app, args)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


EVAL_FILES = {
    "no prompt key": ([{"q": "1+1?"}], "set eval.prompts.prompt_key to the key of the prompt"),
    "missing answer": (
        [{"question": "1+1?", "answer": "2"}, {"question": "3+3?"}],
        "eval.jsonl:2: row has no key 'answer' (eval.prompts.answer_key (picked from row "
        "1: answer_key auto)); its keys are ['question']; fix or drop this row, or set "
        "eval.prompts.answer_key to the key every row has",
    ),
    # a fresh user's probe: a NaN prompt trained as the text 'nan'
    "NaN prompt": (
        [{"question": float("nan"), "answer": "2"}],
        "eval.jsonl:1: 'question' (eval.prompts.prompt_key) is nan, not a finite number",
    ),
    "infinite metadata": (
        [{"question": "1+1?", "answer": "2", "extra_info": {"w": [1.0, float("inf")]}}],
        "eval.jsonl:1: 'extra_info'['w'][1] is inf, not a finite number; fix or drop the row",
    ),
    "empty prompt": ([{"question": " "}], "(eval.prompts.prompt_key) is an empty prompt"),
    "empty file": ([], "eval.prompts.path: "),
    "no ground truth": ([{"question": "9+9?"}], "set eval.prompts.answer_key to the key"),
}


@pytest.mark.parametrize("case", sorted(EVAL_FILES))
def test_errors_of_an_eval_file_name_the_eval_prompts_keys(tmp_path, tiny_model, case):
    rows, needle = EVAL_FILES[case]
    f = _jsonl(tmp_path / "eval.jsonl", rows)
    recipe = _recipe(tmp_path, tiny_model, eval={"prompts": {"path": str(f)}, "every_steps": 2})
    got = _validate(recipe)
    assert got.exit_code == 2 and needle in got.output, got.output
    assert "data.train" not in got.output and "training file" not in got.output, got.output


def test_a_mixture_entry_and_a_folder_split_are_named_by_their_keys(tmp_path, tiny_model):
    f = _jsonl(tmp_path / "a.jsonl", [{"q": "1+1?"}])
    mixture = {"mixture": [{"generator": "arithmetic", "size": 5, "seed": 3}, {"path": str(f)}]}
    got = _validate(_recipe(tmp_path, tiny_model, eval={"prompts": mixture, "every_steps": 2}))
    assert got.exit_code == 2 and "set eval.prompts.mixture.1.prompt_key" in got.output
    folder = tmp_path / "splits"
    folder.mkdir()
    for split in ("test", "validation"):
        datasets.Dataset.from_list([{"question": "1+1?", "answer": "2"}]).to_parquet(
            str(folder / f"{split}.parquet")
        )
    got = _validate(
        _recipe(tmp_path, tiny_model, eval={"prompts": {"path": str(folder)}, "every_steps": 2})
    )
    assert got.exit_code == 2 and "pick one with eval.prompts.split" in got.output, got.output


GROUND_TRUTH = {
    "python_functions": (
        {"generator": "python_functions", "size": 5},
        "data.train (generator python_functions) gives tests, not reference answers: "
        "score it with type: code",
    ),
    "hh file": (
        "hh",
        "data.train (format hh) gives dialogues, no reference answers",
    ),
}


@pytest.mark.parametrize("case", sorted(GROUND_TRUTH))
def test_a_missing_ground_truth_suggests_what_that_source_has(tmp_path, tiny_model, case):
    train, needle = GROUND_TRUTH[case]
    if train == "hh":
        row = {
            "chosen": "\n\nHuman: hi\n\nAssistant: yes",
            "rejected": "\n\nHuman: hi\n\nAssistant: no",
        }
        train = {"path": str(_jsonl(tmp_path / "hh.jsonl", [row])), "format": "hh"}
    got = _validate(_recipe(tmp_path, tiny_model, data={"train": train}))
    assert got.exit_code == 2 and needle in got.output, got.output
    assert "answer_key" not in got.output, got.output


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_chat_generator_as_eval_prompts_is_refused(algorithm):
    got = _refused([f"algorithm={algorithm}", "eval.prompts={generator: tool_chats, size: 10}"])
    assert "eval.prompts: generator 'tool_chats' makes conversations for algorithm: sft" in got
    mixed = "eval.prompts={mixture: [{generator: arithmetic}, {generator: tool_chats}]}"
    assert "eval.prompts.mixture.1: generator 'tool_chats'" in _refused([mixed])


def test_the_final_policy_is_evaluated_whatever_every_steps_says():
    from posttrain.recipes.evaluation import due

    r = load_recipe(QUICKSTART, ["train.steps=4", "eval.before_train=false"])
    assert [v for v in range(5) if due(r, v)] == [4]  # every_steps 10, past the run
    r = load_recipe(QUICKSTART, ["train.steps=25"])
    assert [v for v in range(26) if due(r, v)] == [0, 10, 20, 25]


def test_validate_says_when_every_steps_is_past_the_run(tmp_path, tiny_model):
    recipe = _recipe(
        tmp_path,
        tiny_model,
        eval={"prompts": {"generator": "arithmetic", "size": 5, "seed": 9}, "every_steps": 50},
    )
    got = _validate(recipe)
    assert got.exit_code == 0, got.output
    assert "eval.every_steps (50) is past train.steps (4): the policy is evaluated after " in (
        got.output
    )


def test_eval_max_new_tokens_past_the_context_is_refused_before_training(tmp_path, tiny_model):
    prompts = {"generator": "arithmetic", "size": 5, "seed": 9}
    recipe = _recipe(
        tmp_path,
        tiny_model,
        eval={"prompts": prompts, "every_steps": 2, "max_new_tokens": 100000000},
    )
    got = _validate(recipe)
    assert got.exit_code == 2, got.output
    assert "eval.max_new_tokens: eval.prompts prompt" in got.output
    assert "set eval.max_new_tokens to" in got.output


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_eval_floats_that_no_sample_could_meet_are_refused(value):
    assert "eval.pass_threshold: Input should be a finite number" in _refused(
        [f"eval.pass_threshold={value}"]
    )
    assert "eval.temperature: Input should be a finite number" in _refused(
        [f"eval.temperature={value}"]
    )


def test_an_empty_eval_folder_names_its_key(tmp_path, tiny_model):
    (tmp_path / "empty").mkdir()
    prompts = {"path": str(tmp_path / "empty")}
    got = _validate(_recipe(tmp_path, tiny_model, eval={"prompts": prompts, "every_steps": 2}))
    assert got.exit_code == 2 and "eval.prompts.path: " in got.output, got.output


@pytest.mark.parametrize("item", ["=5", ".lr=5", "train..lr=5", "train.=5"])
def test_set_with_an_empty_key_part_is_refused_naming_the_form(item):
    """`--set '=5'` passed as a key '' and was reported as an unknown key with no name."""
    from posttrain.recipes.loading import apply_overrides

    with pytest.raises(RecipeError, match="expected key.path=value"):
        apply_overrides({"train": {"lr": 1.0}}, [item])


def test_eval_of_an_alias_without_recipe_reads_an_alias():
    """The refusal said 'a alias'."""
    result = CliRunner().invoke(app, ["eval", "smollm2-135m-instruct", "-n", "1"])
    assert result.exit_code == 2
    assert "an alias carries no recipe of its own" in result.output


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rollout.samples_per_prompt=1000000000"],
            "train.prompts_per_step × rollout.samples_per_prompt is 4,000,000,000 rollouts",
        ),
        (["eval.k=1000000000"], "eval.k is 1,000,000,000 samples an evaluation"),
        (["eval.k=10000", "eval.limit=1000"], "eval.k × eval.limit is 10,000,000 samples"),
    ],
)
def test_a_step_or_eval_that_would_queue_too_many_samples_is_refused(overrides, expected):
    assert expected in _refused(overrides)


def test_the_largest_step_and_eval_allowed_validate():
    load_recipe(QUICKSTART, ["train.prompts_per_step=1000", "rollout.samples_per_prompt=1000"])
    load_recipe(QUICKSTART, ["eval.k=1000", "eval.limit=1000"])


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=inf",
        "train.lr=nan",
        "rollout.temperature=inf",
        "rollout.oversample=inf",
        "train.correction.cap=nan",
        "rewards.0.weight=-inf",
        "grpo.kl_coef=nan",
    ],
)
def test_a_non_finite_number_in_any_float_key_is_refused_naming_it(override):
    """`inf` and `nan` pass `ge`/`gt` bounds one way or the other (inf ≥ 1, nan fails
    every comparison but an unbounded field takes it); every recipe block refuses them."""
    key = override.split("=")[0]
    assert f"{key}: Input should be a finite number" in _refused([override])
