"""The `reward_model` reward component on a tiny sequence-classification folder: the
rendering equals the reward-model training's, scores equal transformers' own pooling on
the unpadded sequence whatever the batch, normalisation, and the service's batch path."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.config.rewards import RewardModelReward
from posttrain.recipes.data.pair_tokens import tokenize_pairs_with_template
from posttrain.recipes.data.pairs import PreferencePair
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.reward_model import RewardModelScorer, RunningStats
from posttrain.rewards.service import create_app


@pytest.fixture(scope="module")
def rm_folder(tiny_model, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    folder = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


ITEMS = [
    ScoreItem(uid="a", prompt="What is 2+2?", response="4"),
    ScoreItem(
        uid="b",
        prompt="ignored",
        response="A much longer answer, with words.",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi"},
        ],
    ),
    ScoreItem(uid="c", prompt="Q", response=""),
]


def _spec(path, **kw) -> RewardModelReward:
    return RewardModelReward(name="rm", type="reward_model", path=str(path), **kw)


def test_rendering_is_the_training_rendering(rm_folder):
    scorer = RewardModelScorer(_spec(rm_folder))
    tok = scorer.tokenizer
    for item in ITEMS:
        messages = item.messages or [{"role": "user", "content": item.prompt}]
        pair = tokenize_pairs_with_template(
            [PreferencePair(0, messages, item.response, "x")], tok, 1024
        ).pairs[0]
        assert scorer.token_ids(item) == pair.prompt_ids + pair.chosen_ids
    text = tok.decode(scorer.token_ids(ITEMS[0]))
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"


def test_scores_match_transformers_alone_and_batched(rm_folder):
    one = RewardModelScorer(_spec(rm_folder, batch_size=1))
    many = RewardModelScorer(_spec(rm_folder, batch_size=8))
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    with torch.no_grad():
        want = [
            model(input_ids=torch.tensor([one.token_ids(i)])).logits[0, 0].item() for i in ITEMS
        ]
    torch.testing.assert_close(
        torch.tensor(one.raw_scores(ITEMS)), torch.tensor(want), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor(many.raw_scores(ITEMS)), torch.tensor(want), rtol=0, atol=1e-5
    )
    assert len(set(want)) == 3


def test_max_length_keeps_the_end(rm_folder):
    scorer = RewardModelScorer(_spec(rm_folder, max_length=10))
    full = RewardModelScorer(_spec(rm_folder)).token_ids(ITEMS[1])
    assert scorer.token_ids(ITEMS[1]) == full[-10:]


def test_running_stats_hand_values():
    s = RunningStats()
    s.update([1.0, 3.0])
    assert (s.mean, s.std) == (2.0, 1.0)
    s.update([5.0])  # mean 3, population var (4 + 0 + 4) / 3
    assert s.mean == pytest.approx(3.0) and s.std == pytest.approx((8 / 3) ** 0.5)


def test_fixed_and_running_normalisation(rm_folder):
    raw = RewardModelScorer(_spec(rm_folder)).raw_scores(ITEMS)
    fixed = RewardModelScorer(_spec(rm_folder, normalize="fixed", mean=1.0, std=2.0))
    got = fixed.score_batch(ITEMS)
    assert [g[0] for g in got] == pytest.approx([(r - 1.0) / 2.0 for r in raw], abs=1e-6)
    assert [g[1]["raw"] for g in got] == pytest.approx(raw, abs=1e-6)
    running = RewardModelScorer(_spec(rm_folder, normalize="running"))
    got = [g[0] for g in running.score_batch(ITEMS)]
    mean = sum(raw) / 3
    std = (sum((r - mean) ** 2 for r in raw) / 3) ** 0.5
    assert got == pytest.approx([(r - mean) / std for r in raw], abs=1e-5)


def test_service_scores_the_batch_with_weights(rm_folder):
    raw = RewardModelScorer(_spec(rm_folder)).raw_scores(ITEMS)
    app = create_app(
        [
            {"name": "rm", "type": "reward_model", "path": str(rm_folder), "weight": 0.5},
            {"name": "len", "type": "length", "target_chars": 4},
        ]
    )
    with TestClient(app) as client:
        body = {"items": [i.model_dump() for i in ITEMS]}
        scores = client.post("/score", json=body).json()["scores"]
    assert [s["uid"] for s in scores] == ["a", "b", "c"]
    for s, r, item in zip(scores, raw, ITEMS, strict=True):
        length = max(0.0, 1 - abs(len(item.response) - 4) / 4)
        assert s["details"]["rm"] == pytest.approx(r, abs=1e-5)
        assert s["reward"] == pytest.approx(0.5 * r + length, abs=1e-5)


def test_not_a_reward_model_folder_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="nope does not exist"):
        create_app([{"name": "rm", "type": "reward_model", "path": str(tmp_path / "nope")}])


def test_non_finite_model_scores_fail_their_items_and_stay_out_of_the_statistics(
    rm_folder, monkeypatch
):
    """A broken (or overflowing) model's NaN / inf is an error for its item, never a
    reward, and does not poison the running mean and std of later batches."""
    scorer = RewardModelScorer(_spec(rm_folder, normalize="running"))
    monkeypatch.setattr(
        scorer, "raw_scores", lambda items: [float("nan"), 1.0, float("inf"), 3.0][: len(items)]
    )
    got = scorer.score_batch([*ITEMS, ScoreItem(uid="d", response="x")])
    assert isinstance(got[0], ValueError) and "nan" in str(got[0]) and str(rm_folder) in str(got[0])
    assert isinstance(got[2], ValueError) and "inf" in str(got[2])
    assert got[1] == (-1.0, {"raw": 1.0}) and got[3] == (1.0, {"raw": 3.0})  # mean 2, std 1
    assert scorer.stats.count == 2
    with pytest.raises(ValueError, match="not a finite number"):
        scorer(ITEMS[0])


def test_nan_model_fails_items_through_the_service(rm_folder, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan_rm")
    AutoTokenizer.from_pretrained(rm_folder).save_pretrained(tmp_path / "nan_rm")
    comps = [{"name": "rm", "type": "reward_model", "path": str(tmp_path / "nan_rm")}]
    with TestClient(create_app(comps, workers=1)) as client:
        resp = client.post("/score", json={"items": [i.model_dump() for i in ITEMS[:2]]})
    assert resp.status_code == 200
    for s in resp.json()["scores"]:
        assert s["reward"] is None and s["error"].startswith("rm: ") and "nan" in s["error"], s
