"""A reward model end to end on a tiny model with 2 learner ranks: trained on a planted
preference (chosen replies end with '!', rejected ones with '.') to above-chance
held-out pairwise accuracy, saved as a sequence-classification folder that transformers
loads and that reproduces the learner's scores, then served by the real reward service
(`POST /score` over HTTP) where every chosen reply outscores its rejected one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.common.net import free_port
from posttrain.learner.export import differing_model_files
from posttrain.recipes.algo.reward_model import RewardModel
from posttrain.recipes.data import load_data
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.rewards.client import RewardClient, start_local_service
from posttrain.rewards.protocol import ScoreItem

ROWS = [
    {
        "prompt": f"Tell me about item {i}.",
        "chosen": f"Item {i} is nice!",
        "rejected": f"Item {i} is nice.",
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm_e2e")
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    f = tmp / "rm.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "rm",
                "algorithm": "reward_model",
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": {"path": str(data), "format": "pairs"}},
                "reward_model": {"max_length": 64, "eval_pairs": 8, "eval_every": 5},
                "train": {"steps": 15, "prompts_per_step": 4, "micro_batch_size": 4, "lr": 2e-3},
                "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
            }
        )
    )
    recipe = load_recipe(f)
    history = run(recipe, tmp / "run", None, load_data(recipe)[0])
    return recipe, history, tmp / "run" / "final"


def test_trains_above_chance_and_reports_metrics(trained):
    _, history, _ = trained
    first, last = history[0], history[-1]
    for key in ("loss", "rewards/accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert key in first
    assert first["loss"] == pytest.approx(0.693, abs=0.1)  # a fresh head: r_c ≈ r_r
    assert [m["step"] for m in history if "eval/accuracy" in m] == [4, 9, 14]
    assert last["eval/pairs"] == 8
    assert last["eval/accuracy"] >= 0.875  # chance is 0.5
    assert last["eval/margin"] > 0 and last["eval/loss"] < 0.693  # better than a tie


def test_saved_folder_loads_and_reproduces_the_learner(trained, tiny_model):
    recipe, history, final = trained
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 1 and model.score.weight.shape == (1, 32)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.pad_token_id == tok.pad_token_id == 1
    assert not differing_model_files(tiny_model, final)
    algo = RewardModel(recipe)  # the same pairs, order and eval split as the run
    algo.prepare(SimpleNamespace(model_path=str(tiny_model), data=load_data(recipe)[0]))
    chosen, rejected = [], []
    with torch.no_grad():
        for i in algo.eval_order:
            p = algo.pairs[i]
            for reply, out in ((p.chosen_ids, chosen), (p.rejected_ids, rejected)):
                ids = torch.tensor([p.prompt_ids + reply])
                out.append(model(input_ids=ids).logits[0, 0].item())
    # the last step's eval ran on the weights that were saved
    assert sum(chosen) / 8 == pytest.approx(history[-1]["eval/chosen"], abs=1e-4)
    assert sum(rejected) / 8 == pytest.approx(history[-1]["eval/rejected"], abs=1e-4)


def test_served_through_post_score(trained, tmp_path):
    _, _, final = trained
    port = free_port()
    comps = json.dumps([{"name": "rm", "type": "reward_model", "path": str(final)}])
    proc = start_local_service(comps, port, "tok", tmp_path / "service.log")
    client = RewardClient(f"http://127.0.0.1:{port}/score", token="tok", retries=0)
    try:
        client.wait_ready(timeout_s=120, proc=proc)
        rows = ROWS[-10:]  # train or held out: every pair must rank right
        items = [
            ScoreItem(uid=f"{k}-{i}", prompt=r["prompt"], response=r[k])
            for i, r in enumerate(rows)
            for k in ("chosen", "rejected")
        ]
        scores = {s.uid: s.reward for s in client.score(items)}
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
    assert None not in scores.values()
    for i in range(len(rows)):
        assert scores[f"chosen-{i}"] > scores[f"rejected-{i}"]


def test_ppo_step_on_hh_prompts_against_the_model(trained, tiny_model, tmp_path):
    _, _, final = trained
    hh = tmp_path / "hh.jsonl"
    hh.write_text(
        "".join(
            json.dumps(
                {
                    "chosen": f"\n\nHuman: {r['prompt']}\n\nAssistant: {r['chosen']}",
                    "rejected": f"\n\nHuman: {r['prompt']}\n\nAssistant: {r['rejected']}",
                }
            )
            + "\n"
            for r in ROWS[:4]
        )
    )
    f = tmp_path / "ppo.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "ppo-rm",
                "algorithm": "ppo",
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": {"path": str(hh), "format": "hh"}},
                "rollout": {"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 6},
                "rewards": [
                    {
                        "name": "rm",
                        "type": "reward_model",
                        "path": str(final),
                        "normalize": "running",
                    }
                ],
                "ppo": {"mini_batches": 1, "kl_coef": 0.05},
                "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 2, "lr": 1e-3},
                "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
            }
        )
    )
    recipe = load_recipe(f)
    history = run(recipe, tmp_path / "run", None, load_data(recipe)[0])
    assert history[0]["failed_scores"] == 0 and history[0]["value_loss"] > 0
    rows = [
        json.loads(line)
        for line in (tmp_path / "run" / "rollouts" / "step_00000.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 4 and "messages" not in rows[0]
    assert {r["prompt_text"].split("user\n")[1].split("\n")[0] for r in rows} <= {
        r["prompt"] for r in ROWS[:4]
    }
    # running normalisation over the step's 4 scores: mean 0
    assert sum(r["reward"] for r in rows) == pytest.approx(0.0, abs=1e-4)
    assert all("rm.raw" in r["reward_details"] for r in rows)
