"""Asynchronous GRPO (`train.max_staleness`) end to end on a tiny random model with the
HF engine: no sample trains beyond k policy versions, and each keeps its version in
the rollout files."""

from __future__ import annotations

import json

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.conftest import ROOT
from tests.test_grpo_e2e import _grpo_recipe

#: 4 asynchronous steps of 2 prompts at k = 1
FOUR_STEPS_K1 = {
    "steps": 4,
    "prompts_per_step": 2,
    "micro_batch_size": 2,
    "lr": 1e-3,
    "max_staleness": 1,
}


def check_counts_and_versions(history, run_dir, samples_per_step, newest_k, oldest_k):
    """Partial rollouts' invariants over a run: at every step generated = trained +
    dropped + waiting; every saved sample has one version per response token, never
    going back, `policy_version` its oldest, its newest within `newest_k` of its step and
    its oldest within `oldest_k`."""
    for m in history:
        assert m["samples_generated_total"] == (
            m["samples_trained_total"] + m["samples_dropped_total"] + m["samples_waiting"]
        )
    assert history[-1]["samples_trained_total"] == len(history) * samples_per_step
    for step in range(len(history)):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == samples_per_step
        for r in saved:
            v = r["policy_versions"]
            assert len(v) == len(r["response_ids"]) and v == sorted(v)
            assert r["policy_version"] == v[0]
            assert 0 <= step - v[-1] <= newest_k and step - v[0] <= oldest_k


@pytest.mark.parametrize(
    ("algorithm", "k"),
    # slow: grpo at k = 1 is the bound grpo at k = 2 and ppo at k = 1 both hold
    [pytest.param("grpo", 1, marks=pytest.mark.slow), ("grpo", 2), ("ppo", 1)],
)
def test_no_sample_trains_beyond_k_versions(tiny_model, tmp_path, algorithm, k):
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        algorithm=algorithm,
        train={
            "steps": 4,
            "prompts_per_step": 2,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_staleness": k,
            "correction": {"mode": "tis", "cap": 2.0},
        },
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert 0 <= m["staleness_max"] <= k and m["dropped_stale"] == 0
        assert 0.0 <= m["rollout_idle_fraction"] <= 1.0
        assert 0.0 <= m["learner_idle_fraction"] <= 1.0
        assert m["is_weight_mean"] > 0 and 0 <= m["is_corrected_fraction"] <= 1
        assert m["mismatch_kl_k3"] >= 0 and m["mismatch_abs"] >= 0
    # Generation ran ahead: later steps train on samples of an older policy.
    assert max(m["staleness_max"] for m in history[1:]) >= 1
    for step in range(4):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8  # 2 groups of 4
        assert all(0 <= step - r["policy_version"] <= k for r in saved)
        assert len({r["group_id"] for r in saved}) == 2
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness_max"] for m in lines] == [m["staleness_max"] for m in history]


def _prompts_of(run_dir, step):
    rows = (run_dir / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return sorted({json.loads(x)["prompt_text"] for x in rows})


@pytest.mark.slow  # 47 s; in CI the in-flight prompts go back to a new producer in
# tests/test_fault_drills_e2e.py's restart under staleness (each prompt trained once)
def test_resume_generates_the_in_flight_samples_again(tiny_model, tmp_path):
    from posttrain.recipes import checkpoints

    train = {
        "steps": 4,
        "prompts_per_step": 2,
        "micro_batch_size": 2,
        "lr": 1e-3,
        "max_staleness": 1,
    }
    straight = tmp_path / "straight"
    straight.mkdir()
    run(load_recipe(_grpo_recipe(straight, tiny_model, train=train)), straight / "run")
    split = tmp_path / "split"
    split.mkdir()
    recipe_file = _grpo_recipe(split, tiny_model, train={**train, "steps": 2})
    run(load_recipe(recipe_file), split / "run")  # checkpoint after 2 steps; round 2 in flight
    latest = checkpoints.latest(split / "run")
    history = run(load_recipe(recipe_file, ["train.steps=4"]), split / "run", resume=latest)

    assert [m["policy_version"] for m in history] == [3, 4]
    for step in (2, 3):  # the same prompts as the straight run: none skipped
        assert _prompts_of(split / "run", step) == _prompts_of(straight / "run", step)
    resumed = [json.loads(x) for x in (split / "run" / "rollouts" / "step_00002.jsonl").open()]
    assert all(r["policy_version"] == 2 for r in resumed)  # regenerated under the checkpoint


def _groups_of(run_dir, step):
    """`{group_id: [rollout dicts by sample index]}` trained at `step`."""
    out = {}
    for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open():
        r = json.loads(x)
        out.setdefault(r["group_id"], []).append(r)
    return {g: sorted(rs, key=lambda r: int(r["uid"].rsplit("-", 1)[1])) for g, rs in out.items()}


@pytest.mark.slow  # 68 s at load 9; in CI: the bitwise continuation on one worker
# (tests/actors/test_inflight_prefixes.py) and each prompt once after a resume that
# continues (test_resume_trains_each_prompt_once_with_partial_rollouts)
def test_resume_continues_the_samples_in_flight_bitwise(tiny_model, tmp_path, capsys):
    """Partial rollouts on a paced engine (2 s a request): the run stops after 2 steps
    with the next groups half generated; the checkpoint holds their samples so far and
    the resume continues them: each saved prefix heads its trained sample bitwise
    (tokens, logprobs, versions), and every prompt trains once."""
    from posttrain.recipes import checkpoints

    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 8, "partial": True},
        train={**FOUR_STEPS_K1, "steps": 2},
        resources={"rollout": {"gpus": 1}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        debug={"rollout_delay_s": 2.0},
    )
    run_dir = tmp_path / "run"
    run(load_recipe(recipe_file), run_dir)
    latest = checkpoints.latest(run_dir)
    data = checkpoints.read_state(latest)["data"]
    rows = {int(p): r for p, rs in data["prefixes"].items() for r in rs}
    # a group being scored at that moment has no row: it is generated again, and counted
    assert set(rows) <= set(data["pending"])
    assert len(rows) + data["regenerated"]["prompts"] == len(data["pending"])
    half = [s for r in rows.values() for s in r if not s["done"]]
    assert half and all(0 < len(s["token_ids"]) < 8 for s in half)  # cut mid-sample

    history = run(load_recipe(recipe_file, ["train.steps=4"]), run_dir, resume=latest)
    assert f"resume: {len(rows)} prompts continue" in capsys.readouterr().out
    assert [m["policy_version"] for m in history] == [3, 4]
    assert all(m["samples_dropped"] == 0 for m in history)
    trained = {g: rs for step in (2, 3) for g, rs in _groups_of(run_dir, step).items()}
    for position, row in rows.items():
        (group,) = [rs for g, rs in trained.items() if f"-p{position}-" in g]
        for s, r in zip(row, group, strict=True):
            n = len(s["token_ids"])
            assert r["response_ids"][:n] == s["token_ids"]
            assert r["inference_logprobs"][:n] == s["logprobs"]  # bitwise
            assert r["policy_versions"][:n] == s["versions"]
            assert s["done"] == (len(r["response_ids"]) == n)
    ids = [g.split("-p")[1] for step in range(4) for g in _groups_of(run_dir, step)]
    assert len(ids) == 8 and len({i.split("-")[0] for i in ids}) == 8  # each prompt once


def test_partial_rollouts_tag_versions_and_counts_add_up(tiny_model, tmp_path):
    """`rollout.partial`: pushes land while the engine generates (a threaded worker);
    every saved sample carries one version per token, non-decreasing, its
    `policy_version` the oldest; staleness counts from it; the sample totals add up."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 64, "partial": True},
        train=FOUR_STEPS_K1,
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert m["staleness_max"] <= 1 and m["samples_dropped"] == 0
        assert m["staleness_frac/0"] + m["staleness_frac/1"] == pytest.approx(1.0)
        assert 1.0 <= m["versions_spanned_mean"] <= m["versions_spanned_max"] <= 2.0
    check_counts_and_versions(history, run_dir, samples_per_step=8, newest_k=1, oldest_k=1)


def test_oversampled_partial_rollouts_keep_both_bounds_and_lose_no_sample(tiny_model, tmp_path):
    """The partial-rollout producer sends each group as its own request, up to
    ceil(k × prompts_per_step × oversample) in flight, on a paced engine (a push lands
    between tokens) with a long tail: every trained sample's newest token is within
    max_staleness, its oldest within max_token_staleness, versions never go back, and
    generated = trained + dropped + waiting at every step."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={
            "engine": "hf",
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "partial": True,
            "oversample": 2.0,
        },
        train={**FOUR_STEPS_K1, "max_token_staleness": 2},
        resources={"rollout": {"gpus": 2}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        debug={"rollout_delay_s": 0.2, "rollout_tail_every": 3, "rollout_tail_factor": 6.0},
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert m["staleness_newest_max"] <= 1 and m["staleness_max"] <= 2
    check_counts_and_versions(history, run_dir, samples_per_step=4, newest_k=1, oldest_k=2)


@pytest.mark.slow
def test_budget_drops_no_sample_on_a_long_tail(tiny_model, tmp_path):
    """`train.staleness_policy: budget` on the paced long tail of the test above, with
    no max_token_staleness: the producer pauses while its buffer of 4 groups is full,
    every step trains 2 groups, no sample is dropped for staleness, and generated =
    trained + 0 + waiting at every step. (Slow: a minute of Ray and the paced engine;
    tests/recipes/test_async_stream.py checks `take` and the counts in seconds.)"""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={
            "engine": "hf",
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "partial": True,
            "oversample": 2.0,
        },
        train={
            **FOUR_STEPS_K1,
            "staleness_policy": "budget",
            "correction": {"mode": "decoupled"},
        },
        resources={"rollout": {"gpus": 2}, "learner": {"gpus": 1}, "threads_per_worker": 1},
        debug={"rollout_delay_s": 0.2, "rollout_tail_every": 3, "rollout_tail_factor": 6.0},
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    for m in history:
        assert m["dropped_stale"] == 0 and m["samples_dropped_total"] == 0
        assert sum(v for key, v in m.items() if key.startswith("staleness_frac/")) == (
            pytest.approx(1.0)
        )
    check_counts_and_versions(history, run_dir, samples_per_step=4, newest_k=4, oldest_k=4)


def _trained_prompt_ids(run_dir, steps):
    """The prompt id (`-p<id>-` of each group id) of every group trained at each step."""
    out = []
    for step in range(steps):
        rows = (run_dir / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()
        groups = {json.loads(x)["group_id"] for x in rows}
        out += [int(g.split("-p")[1].split("-")[0]) for g in groups]
    return out


def test_resume_trains_each_prompt_once_with_partial_rollouts(tiny_model, tmp_path):
    """A run stopped after 2 steps with rounds generating or buffered (k = 2) saves them
    as the checkpoint's pending prompts; the resumed run generates them first, and over
    both runs each of the first 10 prompts of the data order trains exactly once."""
    from posttrain.recipes import checkpoints
    from posttrain.recipes.data import prompt_stream

    train = {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 2, "lr": 1e-3}
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={"engine": "hf", "samples_per_prompt": 2, "max_new_tokens": 16, "partial": True},
        train={**train, "max_staleness": 2},
    )
    run_dir = tmp_path / "run"
    run(load_recipe(recipe_file), run_dir)
    latest = checkpoints.latest(run_dir)
    pending = checkpoints.read_state(latest)["data"]["pending"]
    assert 2 <= len(pending) <= 4  # round 2 drawn (and round 3 when it had started)
    history = run(load_recipe(recipe_file, ["train.steps=5"]), run_dir, resume=latest)

    assert [m["policy_version"] for m in history] == [3, 4, 5]
    trained = _trained_prompt_ids(run_dir, 5)
    order = prompt_stream(list(range(20)), 2, seed=load_recipe(recipe_file).data.shuffle_seed)
    first_ten = [p for _ in range(5) for p in next(order)]
    assert sorted(trained) == sorted(first_ten)  # each once, none skipped
    assert set(pending) <= set(trained[4:])  # the pending ones trained after the resume


@pytest.mark.parametrize(
    "partial",
    # slow: the rounds' counting is tests/recipes/test_dynamic.py's; staleness is the kept one's
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["rounds", "one-group-requests"],
)
def test_dynamic_sampling_under_staleness_drops_flat_groups_and_counts_add_up(
    tiny_model, tmp_path, partial
):
    """`grpo.dynamic_sampling` with k = 1: a random model scores 0 on every math prompt,
    so every group is flat; each step waits for max_rounds × prompts_per_step = 4 of
    them, trains on 2 (zero advantages), drops the rest, and the totals add up; the
    same when partial rollouts send each group as its own request."""
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 6, "partial": partial},
        rewards=[{"name": "correct", "type": "math"}],
        grpo={"dynamic_sampling": True, "max_rounds": 2},
        train={
            "steps": 3,
            "prompts_per_step": 2,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "max_staleness": 1,
        },
    )
    history = run(load_recipe(recipe_file), tmp_path / "run")

    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for m in history:
        assert m["samples_trained"] == 8 and m["staleness_max"] <= 1
        assert m["dynamic/dropped_groups"] >= 2  # 4 scored for the step, 2 trained
        assert m["samples_dropped"] == 4 * m["dynamic/dropped_groups"] + m["dropped_stale"]
        assert m["samples_generated_total"] == (
            m["samples_trained_total"] + m["samples_dropped_total"] + m["samples_waiting"]
        )
    assert history[-1]["samples_trained_total"] == 24
    assert history[-1]["samples_dropped_flat_total"] >= 3 * 8


def test_multi_turn_episodes_under_staleness(tiny_model, tmp_path, monkeypatch):
    """`rollout.max_turns` 3 with a Python environment at k = 1: episodes are generated
    a step ahead, each keeps the version it was generated under (staleness ≤ 1, some
    1), and the environment's turns are in the saved samples."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        rollout={
            "engine": "hf",
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
            "stop": list("aeiou"),
            "max_turns": 3,
            "max_episode_tokens": 120,
            "environment": {"type": "python", "class_path": "guess_env:GuessingGame"},
        },
        rewards=[{"name": "short", "type": "length", "target_chars": 3}],
        train={
            "steps": 3,
            "prompts_per_step": 2,
            "micro_batch_size": 4,
            "lr": 1e-3,
            "max_staleness": 1,
        },
    )
    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert max(m["staleness_max"] for m in history[1:]) == 1
    assert max(m["episode/turns_mean"] for m in history) > 1.0
    for m in history:
        assert m["staleness_max"] <= 1 and m["failed_scores"] == 0
    multi = 0
    for step in range(3):
        saved = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").open()]
        assert len(saved) == 8 and all(0 <= step - r["policy_version"] <= 1 for r in saved)
        multi += sum(len(r["turns"]) > 1 for r in saved)
        for r in saved:
            assert [i for t in r["turns"] for i in t["ids"]] == r["response_ids"]
    assert multi > 0  # the environment answered some episodes
