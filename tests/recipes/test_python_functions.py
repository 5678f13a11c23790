"""`generator: python_functions` (recipes/data/tasks/functions.py): deterministic problems in
HumanEval's layout whose tests pass the reference solution and fail a wrong one, scored by
the code reward; held-out functions are kept out of training."""

from __future__ import annotations

import pytest

from posttrain.recipes.data import load_data
from posttrain.recipes.data.tasks.functions import (
    TEMPLATES,
    problem,
    problem_space,
    python_functions,
)
from posttrain.recipes.loading import load_recipe
from posttrain.rewards.code_verifier import score_code
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.sandbox import BwrapSandbox, Limits

LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=256, max_procs=16)


def test_the_problem_space_is_distinct_and_stable():
    space = problem_space()
    assert len(space) == 408
    names = [problem(t, p)["name"] for t, p in space]
    assert len(set(names)) == len(names)
    assert python_functions(5, 3) == python_functions(5, 3)
    assert [p["name"] for p in python_functions(3, 0)] == [
        p["name"] for p in python_functions(3, 0)
    ]
    assert python_functions(3, 0) != python_functions(3, 1)
    # a size above the space repeats it, each problem once per cycle
    cycled = [p["name"] for p in python_functions(len(space) + 2, 0)]
    assert len(set(cycled)) == len(space) and cycled[:2] == cycled[-2:]


def test_the_prompt_of_add_12_is_the_exact_humaneval_layout():
    add = next(t for t in TEMPLATES if t.stem == "add")
    p = problem(add, 12)
    assert p["entry_point"] == "add_12" and p["prompt"] == p["code_prefix"]
    assert p["prompt"].startswith(
        'def add_12(x: int) -> int:\n    """Return x plus 12.\n    >>> add_12('
    )
    assert p["test"].startswith("def check(candidate):\n    assert candidate(")
    assert p["test"].count("assert") == 5


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_the_reference_passes_the_tests_and_a_wrong_answer_fails(template):
    param = template.params[len(template.params) // 2]
    p = problem(template, param)
    scope: dict = {}
    exec(p["prompt"] + "    pass\n" + p["test"], scope)  # the prompt is valid Python
    scope["check"](lambda *a: template.ref(param, *a))
    with pytest.raises(AssertionError):
        scope["check"](lambda *a: "wrong")
    # the docstring's example is the reference's answer
    lines = p["prompt"].splitlines()
    reference = {p["name"]: lambda *a: template.ref(param, *a)}
    assert eval(lines[2].split(">>> ")[1], reference) == eval(lines[3])  # our own text


def test_the_code_reward_scores_a_body_and_a_whole_function():
    sandbox = BwrapSandbox()
    add = next(t for t in TEMPLATES if t.stem == "add")
    meta = {
        k: v for k, v in problem(add, 12).items() if k in ("code_prefix", "test", "entry_point")
    }
    for reply, want in [
        ("    return x + 12\n", 1.0),
        ("```python\ndef add_12(x: int) -> int:\n    return 12 + x\n```", 1.0),
        ("    return x + 13\n", 0.0),
        ("return x + 12", 0.0),  # not indented: the prefix's function has no body line
    ]:
        got = score_code(ScoreItem(uid="s", response=reply, metadata=meta), sandbox, LIMITS)
        assert got[0] == want, (reply, got)


def test_heldout_functions_stay_out_of_training(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        "name: t\nalgorithm: grpo\nmodel: {path: smollm2-135m-instruct}\n"
        "data:\n  train: {generator: python_functions, size: 408, seed: 0}\n"
        "rewards: [{name: tests, type: code}]\n"
        "train: {steps: 1, prompts_per_step: 1}\n"
        "eval: {prompts: {generator: python_functions, size: 200, seed: 1000}, every_steps: 1}\n"
    )
    data = load_data(load_recipe(recipe_file))
    train = {p.metadata["entry_point"] for p in data.train}
    held = {p.metadata["entry_point"] for p in data.eval}
    assert len(held) == 200 and len(train) == 208 and not train & held


def _validate(tmp_path, train: str):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        "name: t\nalgorithm: grpo\nmodel: {path: smollm2-135m-instruct}\n"
        f"data:\n  train: {train}\n"
        "rewards: [{name: tests, type: code}]\ntrain: {steps: 1, prompts_per_step: 1}\n"
    )
    return load_recipe(recipe_file)


def test_the_schema_knows_the_problem_space():
    from posttrain.config.data import PYTHON_FUNCTIONS

    assert PYTHON_FUNCTIONS == len(problem_space())


@pytest.mark.parametrize(
    ("train", "says"),
    [
        ("{generator: python_functions, size: 409}", "python_functions has 408 distinct problems"),
        ("{generator: python_functions}", "size is 2000, but python_functions has 408"),
        ("{generator: python_functions, size: 8, operators: ['*']}", "operators apply to"),
        ("{generator: python_functions, size: 8, min_digits: 2}", "min_digits apply to"),
    ],
)
def test_sizes_past_the_space_and_arithmetic_keys_are_refused(tmp_path, train, says):
    from posttrain.config import RecipeError

    with pytest.raises(RecipeError, match=says):
        _validate(tmp_path, train)
