"""An algorithm's facts (config/facts.py) against what its step really asks of the learner:
a stand-in learner counts every `compute` (by kind) and the rows every `train_step`
trains, for each algorithm and the settings that change its passes, and the counts must
equal `recipe.facts.passes`, which the planners turn into FLOPs. So the planner cannot
drift from the code again (it once counted a PPO step without its three no-grad forwards
and never multiplied by `ppo.epochs`)."""

from __future__ import annotations

import ast
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import posttrain.recipes.algo.base as base_mod
import posttrain.recipes.algo.distill as distill_mod
import posttrain.recipes.algo.dpo as dpo_mod
import posttrain.recipes.algo.grpo as grpo_mod
import posttrain.recipes.algo.ppo as ppo_mod
import posttrain.recipes.algo.reward_model as rm_mod
from posttrain.actors.rollout import Rollout
from posttrain.config import Passes, default_facts
from posttrain.recipes.algo import algorithm_for
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.data.pair_tokens import TokenizedPair
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.planning.planner import step_flops
from tests.conftest import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart_grpo.yaml"
HH = ["data.train={path: pairs.jsonl, format: pairs}", "eval=null", "rewards=[]"]


class StandIn:
    """Counts the learner work of one step: `compute` calls by kind, and the rows each
    `train_step` trains (a pass over the batch = its real rows once)."""

    def __init__(self) -> None:
        self.computes: Counter[str] = Counter()
        self.trained_rows = 0

    def on_learners(self, learners, method, batch, step, *args):
        if method == "compute":
            kind = args[0]
            self.computes[kind] += 1
            width = batch.input_ids.shape[1] + (1 if kind == "values" else 0)
            shard = torch.zeros(len(batch) // len(learners), width)  # each rank's rows
            return [shard] * len(learners)
        if method == "train_step":
            self.trained_rows += int((batch.response_mask.sum(-1) > 0).sum())
            return [{"loss": 0.0, "grad_norm": 1.0, "lr": 0.1}] * len(learners)
        raise AssertionError(method)

    def drain(self):
        return SimpleNamespace(remote=lambda: [])


def _rollouts(n: int) -> list[Rollout]:
    return [
        Rollout(
            uid=f"g{i // 4}-{i}",
            group_id=f"g{i // 4}",
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            inference_logprobs=[-0.5] * 3,
            finish_reason="stop",
            policy_version=0,
            prompt_text="p",
            response_text="r",
        )
        for i in range(n)
    ]


def _patch(monkeypatch, stand_in: StandIn) -> None:
    for mod in (base_mod, grpo_mod, ppo_mod, dpo_mod, rm_mod, distill_mod):
        monkeypatch.setattr(mod, "on_learners", stand_in.on_learners, raising=False)
    fake_ray = SimpleNamespace(get=lambda refs: refs)
    monkeypatch.setattr(dpo_mod, "ray", fake_ray)
    monkeypatch.setattr(rm_mod, "ray", fake_ray)


def _counted(stand_in: StandIn, rows: int) -> Passes:
    critic = stand_in.computes["values"] > 0
    epochs = stand_in.trained_rows // rows
    return Passes(
        policy_forward=stand_in.computes["old_logprobs"],
        reference_forward=stand_in.computes["ref_logprobs"],
        critic_forward=stand_in.computes["values"],
        policy_train=epochs,
        critic_train=epochs if critic else 0,
    )


ROLLOUT_CASES = [
    ["rollout.temperature=1.0"],  # the quickstart: one update, no KL
    ["grpo.kl_coef=0.1"],
    ["grpo.epochs=2", "grpo.mini_batches=2"],
    ["grpo.old_logprob_pass=always"],
    ["algorithm=ppo"],
    ["algorithm=ppo", "ppo.kl_coef=0.05", "ppo.epochs=3", "ppo.mini_batches=2"],
    ["algorithm=distill", "distill.teacher=t"],
    ["algorithm=distill", "distill.teacher=t", "distill.reward_weight=0.5"],
]


@pytest.mark.parametrize("overrides", ROLLOUT_CASES, ids=lambda o: ",".join(o))
def test_rollout_step_passes_equal_the_facts(monkeypatch, overrides):
    stand_in = StandIn()
    _patch(monkeypatch, stand_in)
    recipe = load_recipe(QUICKSTART, ["rollout.max_new_tokens=8", *overrides])
    algo = algorithm_for(recipe)
    rollouts = _rollouts(8)
    rewards = [float(i % 2) for i in range(8)]
    batch = rollout_batch(rollouts, rewards, pad_id=0)
    algo.train([None, None], batch, rollouts, rewards, step=0)
    assert _counted(stand_in, len(rollouts)) == recipe.facts.passes
    assert algo.load_reference == recipe.facts.reference
    assert (algo.critic is not None) == recipe.facts.critic


def _pairs(n: int) -> list[TokenizedPair]:
    return [TokenizedPair([1, 2], [3, 4, 2], [5, 2]) for _ in range(n)]


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=dpo"],
        ["algorithm=dpo", "dpo.precompute_ref_logprobs=false"],
        ["algorithm=reward_model"],
    ],
    ids=lambda o: ",".join(o),
)
def test_pair_step_passes_equal_the_facts(monkeypatch, tmp_path, overrides):
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    stand_in = StandIn()
    _patch(monkeypatch, stand_in)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(QUICKSTART.read_text())
    recipe = load_recipe(recipe_file, [*HH, *overrides])
    algo = algorithm_for(recipe)
    per_step = recipe.train.prompts_per_step
    algo.pairs, algo.order = _pairs(per_step), list(range(per_step))
    algo.margins = [0.0] * per_step
    algo.eval_order = []
    if getattr(algo, "ref_all", "absent") is None and recipe.dpo.precompute_ref_logprobs:
        algo.ref_all = torch.zeros(2 * per_step)
    learner = SimpleNamespace(drain_spans=stand_in.drain())
    run = SimpleNamespace(roles=SimpleNamespace(learners=[learner], pad_id=0))
    algo.step(run, 0)
    assert _counted(stand_in, 2 * per_step) == recipe.facts.passes
    assert algo.load_reference == recipe.facts.reference
    assert not algo.uses_rollouts


def test_step_flops_by_hand():
    """N = 10 parameters, 100 policy tokens, 120 critic tokens."""
    ppo = load_recipe(QUICKSTART, ["algorithm=ppo", "ppo.kl_coef=0.1", "ppo.epochs=2"])
    # policy: 6N·2 train + 2N·(old + ref) = 120 + 40 per token; critic 6N·2 + 2N = 140
    assert step_flops(ppo, 10, 100, 120) == 160 * 100 + 140 * 120
    grpo = load_recipe(QUICKSTART, [])  # one update, no reference: 6N per token
    assert step_flops(grpo, 10, 100, 120) == 60 * 100
    lora = load_recipe(QUICKSTART, ["model.adapter={type: lora}", "grpo.kl_coef=0.1"])
    assert step_flops(lora, 10, 100, 120) == (40 + 20) * 100  # 4N train + 2N reference


@pytest.mark.parametrize("packing", ["true", "false"])
def test_sft_step_passes_equal_the_facts(monkeypatch, tmp_path, packing):
    import posttrain.recipes.algo.sft as sft_mod
    from posttrain.recipes.data.chats import TokenizedChat

    (tmp_path / "chats.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    stand_in = StandIn()
    _patch(monkeypatch, stand_in)
    monkeypatch.setattr(sft_mod, "on_learners", stand_in.on_learners)
    monkeypatch.setattr(sft_mod, "ray", SimpleNamespace(get=lambda refs: refs))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(QUICKSTART.read_text())
    recipe = load_recipe(
        recipe_file,
        ["algorithm=sft", "data.train={path: chats.jsonl}", "eval=null", "rewards=[]"]
        + [f"sft.packing={packing}"],
    )
    algo = algorithm_for(recipe)
    per_step = recipe.train.prompts_per_step
    algo.chats = [TokenizedChat([1, 2, 3], [0, 1, 1])] * per_step
    algo.order, algo.eval_order = list(range(per_step)), []
    learner = SimpleNamespace(drain_spans=stand_in.drain())
    run = SimpleNamespace(roles=SimpleNamespace(learners=[learner], pad_id=0))
    algo.step(run, 0)
    rows = 1 if packing == "true" else per_step  # packed: 4 x 3 tokens fit one row
    assert _counted(stand_in, rows) == recipe.facts.passes
    assert not algo.load_reference and not algo.uses_rollouts


SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_default_facts_agree_with_the_loaded_recipe(path):
    """`default_facts` (for a recipe not yet validated) gives the data kind and head the
    validated recipe's own facts give, and its algorithm object's head is the fact's."""
    recipe = load_recipe(path)
    got = default_facts(recipe.algorithm)
    assert (got.data, got.head) == (recipe.facts.data, recipe.facts.head)
    assert algorithm_for(recipe).head == recipe.facts.head


def test_default_facts_of_names_that_are_no_algorithm():
    assert default_facts(None) is None
    assert default_facts("model") is None  # a recipe key, not an algorithm
    assert default_facts("ddpo") is None
    assert (default_facts("reward_model").data, default_facts("reward_model").head) == (
        "pairs",
        "score",
    )
    assert (default_facts("dpo").data, default_facts("dpo").head) == ("pairs", "lm")


def _name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a recipe's algorithm (`x.algorithm`, `x.get("algorithm")`,
    `x["algorithm"]`) to a name or a tuple of names."""

    def is_algorithm(node: ast.AST) -> bool:
        key = ast.dump(ast.Constant("algorithm"))
        if isinstance(node, ast.Attribute):
            return node.attr == "algorithm"
        if isinstance(node, ast.Subscript):
            return ast.dump(node.slice) == key
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and bool(node.args)
            and ast.dump(node.args[0]) == key
        )

    def is_name(node: ast.AST) -> bool:
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return bool(node.elts) and all(is_name(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(is_algorithm(x) for x in [node.left, *node.comparators])
        and any(is_name(x) for x in [node.left, *node.comparators])
    ]


def test_the_comparison_finder():
    src = (
        'a = r.algorithm == "dpo"\nb = t.get("algorithm") in ("dpo", "rm")\n'
        'c = t["algorithm"] != "grpo"\nd = r.facts.data == "pairs"\ne = r.algorithm == x\n'
    )
    assert _name_comparisons(ast.parse(src)) == [1, 2, 3]


def test_consumers_read_the_facts_not_algorithm_names():
    """Outside the schema (config/, where each block states its facts and the validators
    name the algorithm they check), no module compares `algorithm` to a name: it reads
    `recipe.facts` (or `default_facts` before validation)."""
    found = []
    for top in ["actors", "algorithms", "common", "learner", "recipes", "rewards", "service"]:
        for f in sorted((ROOT / top).rglob("*.py")):
            found += [
                f"{f.relative_to(ROOT)}:{n}" for n in _name_comparisons(ast.parse(f.read_text()))
            ]
    assert found == []
