"""Evaluation during training: pass@k (Chen et al. 2021) on hand values, the metrics of a
hand-made eval batch, and a tiny-model run that evaluates before and during training."""

from __future__ import annotations

import json
from math import comb

import pytest
import yaml

from posttrain.actors.rollout import Rollout
from posttrain.config import RecipeError
from posttrain.recipes.evaluation import eval_metrics, pass_at_k
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.rewards.protocol import Score


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k
    assert pass_at_k(4, 4, 4) == 1.0


def test_pass_at_k_matches_binomials_where_they_are_small():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert 0.0 < pass_at_k(2000, 3, 100) < 1.0  # no overflow for large n


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def _r(group: str, i: int) -> Rollout:
    return Rollout(
        uid=f"{group}-{i}",
        group_id=group,
        prompt_ids=[1],
        response_ids=[2],
        inference_logprobs=[-0.1],
        finish_reason="stop",
        policy_version=0,
        prompt_text="p",
        response_text="r",
    )


def test_eval_metrics_hand_made():
    # prompt a: 1 of 2 right; prompt b: none right, one sample unscored
    rollouts = [_r("a", 0), _r("a", 1), _r("b", 0), _r("b", 1)]
    scores = [
        Score(uid="a-0", reward=1.0, details={"math": 1.0, "fmt": 1.0}),
        Score(uid="a-1", reward=0.5, details={"math": 0.0, "fmt": 1.0}),
        Score(uid="b-0", reward=0.0, details={"math": 0.0, "fmt": 0.0}),
        Score(uid="b-1", reward=None, error="timeout"),
    ]
    m = eval_metrics(rollouts, scores, k=2, threshold=1.0)
    assert m["eval/prompts"] == 2 and m["eval/k"] == 2
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@k"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/avg@k"] == pytest.approx((0.75 + 0.0) / 2)  # unscored counts 0
    assert m["eval/pass@k/fmt"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/pass@1/fmt"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/avg@k/math"] == pytest.approx((0.5 + 0.0) / 2)


def _recipe_file(tmp_path, tiny_model, **over):
    tree = {
        "name": "eval-e2e",
        "algorithm": "grpo",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": {"generator": "arithmetic", "size": 8}},
        "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 4},
        "rewards": [{"name": "len", "type": "length", "target_chars": 3}],
        "train": {"steps": 2, "prompts_per_step": 2, "save_final": False},
        "resources": {"learner": {"gpus": 1}, "threads_per_worker": 1},
        "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
        "eval": {
            "prompts": {"path": "held_out.jsonl", "prompt_key": "q", "answer_key": "a"},
            "every_steps": 1,
            "before_train": True,
            "k": 3,
            "limit": 2,
        },
        **over,
    }
    (tmp_path / "held_out.jsonl").write_text(
        "".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) + "\n" for i in range(5))
    )
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(tree))
    return f


def test_dpo_with_eval_is_refused(tmp_path, tiny_model):
    f = _recipe_file(
        tmp_path,
        tiny_model,
        algorithm="dpo",
        data={"train": {"path": "p.jsonl", "format": "pairs"}},
    )
    with pytest.raises(RecipeError, match="DPO samples no responses"):
        load_recipe(f)


@pytest.mark.parametrize("k", [0, 1])
def test_eval_before_and_during_training(tmp_path, tiny_model, capsys, k):
    """k = 1: the evaluation pauses the rollout stream, so it samples the version it
    names while generation for later steps runs between evaluations."""
    run_dir = tmp_path / "run"
    train = {"steps": 2, "prompts_per_step": 2, "save_final": False, "max_staleness": k}
    history = run(load_recipe(_recipe_file(tmp_path, tiny_model, train=train)), run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # versions 0 (before training), 1 (after step 0) in the step rows, 2 in a final row
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["eval/policy_version"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0
        assert r["eval/prompts"] == 2 and r["eval/k"] == 3 and "eval/avg@k/len" in r
    for v in (0, 1, 2):
        samples = [
            json.loads(x)
            for x in (run_dir / "eval" / f"step_{v:05d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 2 * 3 and all(s["group_id"].startswith(f"e{v}-") for s in samples)
        assert all(s["policy_version"] == v for s in samples)
    train_ids = [
        json.loads(x)["group_id"]
        for x in (run_dir / "rollouts" / "step_00000.jsonl").read_text().splitlines()
    ]
    assert len(train_ids) == 4 and all(g.startswith("s0-") for g in train_ids)
    assert all(isinstance(h["advisories"], list) for h in history)
    printed = capsys.readouterr()
    out = printed.out + printed.err
    assert "eval of policy 0: pass@1" in out
    # the tiny random model runs every sample to max_new_tokens 4: `truncated` at both
    # steps is printed once, when it starts, not at every step
    assert all(any(a.startswith("truncated:") for a in h["advisories"]) for h in history)
    assert out.count("advisory truncated") == 1 and "step 0: advisory truncated:" in out
