"""`posttrain eval TARGET` on tiny models, one test per kind of target: a run folder, a
checkpoint, a saved policy, an adapter folder and a model alias; a reward model, a DPO
policy and a GRPO policy; and bad input (exit 2 naming the path and the fix).

The checks are against values the runs compute themselves: a reward model's held-out
accuracy equals the last in-training `eval/accuracy` (the same pairs and scores), the
base model against itself as DPO reference gives accuracy 0.5 and margin 0 exactly
(every pair a tie), a checkpoint after the last step evaluates as the final policy.
"""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from posttrain.recipes.assess import targets as eval_targets
from posttrain.recipes.cli import app
from posttrain.recipes.data import load_data
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run

MONITOR = {"progress": False, "dashboard_port": None, "tensorboard": False}


def _pairs(path, first, last):
    rows = [
        {"prompt": f"Tell me about item {i}.", "chosen": f"Item {i}!", "rejected": f"Item {i}."}
        for i in range(first, last)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp, name, tree):
    f = tmp / f"{name}.yaml"
    f.write_text(yaml.safe_dump({"name": name, **tree}))
    return f


def _eval(*args):
    res = CliRunner().invoke(app, ["eval", *map(str, args)])
    return res.exit_code, res.output


def _report(tmp, *args):
    out = tmp / f"report-{len(list(tmp.glob('report-*')))}.json"
    code, text = _eval(*args, "--json", out)
    assert code == 0, text
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rm_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_rm")
    f = _recipe(
        tmp,
        "rm",
        {
            "algorithm": "reward_model",
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {
                "train": {"path": str(_pairs(tmp / "train.jsonl", 0, 32)), "format": "pairs"},
                "heldout": {"path": str(_pairs(tmp / "held.jsonl", 100, 110)), "format": "pairs"},
            },
            "reward_model": {"max_length": 64, "eval_every": 6},
            "train": {"steps": 6, "prompts_per_step": 4, "micro_batch_size": 4, "lr": 2e-3},
            "resources": {"learner": {"gpus": 1}, "threads_per_worker": 1},
            "monitor": MONITOR,
        },
    )
    recipe = load_recipe(f)
    history = run(recipe, tmp / "run", None, load_data(recipe)[0])
    return tmp, history


def test_reward_model_run_folder_matches_the_in_training_eval(rm_run):
    tmp, history = rm_run
    rep = _report(tmp, tmp / "run")
    assert rep["kind"] == "run" and rep["evaluation"] == "reward model"
    assert rep["metrics"]["pairs"] == 10 == history[-1]["eval/pairs"]
    assert rep["metrics"]["accuracy"] == pytest.approx(history[-1]["eval/accuracy"], abs=1e-9)
    assert rep["metrics"]["margin"] == pytest.approx(history[-1]["eval/margin"], abs=1e-4)
    assert len(rep["items"]) == 10


def test_saved_policy_folder_takes_its_runs_recipe(rm_run):
    tmp, _ = rm_run
    whole, final = _report(tmp, tmp / "run"), _report(tmp, tmp / "run" / "final")
    assert final["kind"] == "policy" and final["metrics"] == whole["metrics"]


@pytest.fixture(scope="module")
def dpo_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_dpo")
    tree = {
        "algorithm": "dpo",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {
            "train": {"path": str(_pairs(tmp / "train.jsonl", 0, 16)), "format": "pairs"},
            "heldout": {"path": str(_pairs(tmp / "held.jsonl", 100, 108)), "format": "pairs"},
        },
        "dpo": {"beta": 0.1, "max_length": 64},
        "train": {
            "steps": 4,
            "prompts_per_step": 4,
            "micro_batch_size": 4,
            "lr": 1e-2,
            "checkpoint_every": 4,
        },
        "resources": {"learner": {"gpus": 1}, "threads_per_worker": 1},
        "monitor": MONITOR,
    }
    full = _recipe(tmp, "dpo", tree)
    lora = _recipe(
        tmp,
        "dpo-lora",
        {**tree, "model": {**tree["model"], "adapter": {"type": "lora", "r": 4, "alpha": 8}}},
    )
    for f, out in ((full, "run"), (lora, "lora")):
        recipe = load_recipe(f)
        run(recipe, tmp / out, None, load_data(recipe)[0])
    return tmp, full


def test_dpo_policy_learns_the_planted_preference(dpo_run):
    tmp, _ = dpo_run
    rep = _report(tmp, tmp / "run")
    assert rep["evaluation"] == "dpo" and rep["metrics"]["pairs"] == 8
    assert rep["metrics"]["accuracy"] > 0.5 and rep["metrics"]["margin"] > 0


def test_checkpoint_after_the_last_step_is_the_final_policy(dpo_run):
    tmp, _ = dpo_run
    ck = _report(tmp, tmp / "run" / "checkpoints" / "step_00004")
    final = _report(tmp, tmp / "run" / "final")
    assert ck["kind"] == "checkpoint"
    for key in ("accuracy", "margin", "chosen", "rejected"):
        assert ck["metrics"][key] == pytest.approx(final["metrics"][key], abs=1e-4)


def test_adapter_folder_is_merged_into_its_base(dpo_run):
    tmp, _ = dpo_run
    rep = _report(tmp, tmp / "lora" / "final")
    assert rep["kind"] == "adapter" and rep["metrics"]["pairs"] == 8
    assert rep["metrics"]["margin"] != 0.0  # the adapter moved the policy off its base


def test_qlora_run_is_scored_on_the_base_it_is_compared_with(dpo_run):
    """A QLoRA run's merged/ is the NF4-dequantised base plus the adapter; against the
    float base the quantisation error alone moved every log-ratio (margin 0.224 where the
    adapter on its own base gave 0.007: issue 27's dpo_qlora rows). At lr 1e-9 one step
    moves each weight by about one float32 ulp, so the run must score as its base."""
    tmp, full = dpo_run
    tree = yaml.safe_load(full.read_text())
    tree["model"]["adapter"] = {"type": "qlora", "r": 4, "alpha": 8, "save_merged": True}
    tree["train"].update(steps=1, lr=1e-9)
    recipe = load_recipe(_recipe(tmp, "dpo-qlora", tree))
    run(recipe, tmp / "qlora", None, load_data(recipe)[0])
    assert (tmp / "qlora" / "final" / "merged" / "config.json").is_file()
    rep = _report(tmp, tmp / "qlora")
    assert rep["kind"] == "run"
    m = rep["metrics"]
    assert max(abs(m["chosen"]), abs(m["rejected"]), abs(m["margin"])) < 1e-6


def test_alias_against_itself_ties_every_pair(dpo_run, tiny_model, monkeypatch):
    tmp, recipe = dpo_run
    monkeypatch.setitem(eval_targets.KNOWN_ALIASES, "tiny-alias", ("x", "y"))
    monkeypatch.setattr(eval_targets, "resolve_model_path", lambda _alias: tiny_model)
    rep = _report(tmp, "tiny-alias", "--recipe", recipe)
    assert rep["kind"] == "alias"
    assert rep["metrics"]["accuracy"] == 0.5 and rep["metrics"]["margin"] == 0.0


def test_grpo_policy_sampled_and_scored(tiny_model, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(3)))
    f = _recipe(
        tmp_path,
        "grpo",
        {
            "algorithm": "grpo",
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {"train": {"generator": "arithmetic", "size": 8}},
            "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
            "rewards": [{"name": "len", "type": "length", "target_chars": 3}],
            "train": {"steps": 1, "prompts_per_step": 2, "save_final": False},
            "resources": {"learner": {"gpus": 1}, "threads_per_worker": 1},
            "monitor": MONITOR,
            "eval": {
                "prompts": {"path": str(held), "prompt_key": "q", "answer_key": "a"},
                "every_steps": 1,
                "k": 2,
            },
        },
    )
    rep = _report(tmp_path, tiny_model, "--recipe", f, "-n", 3)
    m = rep["metrics"]
    assert rep["kind"] == "policy" and rep["evaluation"] == "sampling"
    assert m["prompts"] == 3 and m["k"] == 3 and len(rep["items"]) == 3
    assert 0 <= m["pass@1"] <= m["pass@k"] <= 1 and 0 < m["length_mean"] <= 4


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda t: t / "missing", "no such file or folder"),
        (lambda t: (t / "f.txt").write_text("x") and t / "f.txt", "is a file"),
        (lambda t: (t / "empty").mkdir() or t / "empty", "none of the kinds"),
    ],
)
def test_bad_target_exits_2_naming_path_and_fix(tmp_path, make, says):
    path = make(tmp_path)
    code, text = _eval(path)
    assert code == 2 and says in text and str(path) in text and "a run folder" in text


def test_policy_without_a_recipe_asks_for_one(tiny_model):
    code, text = _eval(tiny_model)
    assert code == 2 and "--recipe" in text and str(tiny_model) in text
