"""What the asynchronous loop's checkpoint keeps of the prompts not trained yet and how
a resume hands their saved samples back (recipes/async_loop/inflight.py), pure."""

from __future__ import annotations

import json

from posttrain.actors.rollout import PromptRequest, Rollout
from posttrain.recipes.async_loop import Group, inflight

HALF = {"token_ids": [5], "logprobs": [-0.5], "versions": [2], "finish_reason": "length"}
ROW = [{**HALF, "done": False}, {**HALF, "done": True, "finish_reason": "stop"}]


def _rollout(k: int, tokens: list[int]) -> Rollout:
    return Rollout(
        uid=f"s1-p4-0-{k}",
        group_id="s1-p4-0",
        prompt_ids=[1],
        response_ids=tokens,
        inference_logprobs=[-0.25] * len(tokens),
        finish_reason="stop",
        policy_version=1,
        prompt_text="",
        response_text="",
        policy_versions=[1] * len(tokens),
    )


def test_untrained_prompts_keep_their_rows_and_the_rest_is_counted():
    untrained = {"s3-p7-0": 7, "s3-p9-1": 9, "s4-p2-0": 2}
    state = inflight.saved_state(untrained, {"s3-p7-0": ROW}, {11: [ROW]}, engines_cannot=False)
    assert state["prefixes"] == {"11": [ROW], "7": [ROW]}
    assert state["regenerated"]["prompts"] == 2
    back = inflight.loaded(json.loads(json.dumps(state)))
    assert back == {11: [ROW], 7: [ROW]}


def test_finished_groups_are_saved_as_done_samples_in_sample_order():
    g = Group([_rollout(1, [8]), _rollout(0, [6, 7])], [], 1)
    (row,) = inflight.finished_rows([g]).values()
    assert [s["token_ids"] for s in row] == [[6, 7], [8]]
    assert all(s["done"] and s["versions"] == [1] * len(s["token_ids"]) for s in row)


def test_a_row_goes_with_its_prompt_once():
    reqs = [PromptRequest("s5-p7-0", []), PromptRequest("s5-p7-1", [])]
    saved = {7: [ROW]}
    out = inflight.attach(reqs, {"s5-p7-0": 7, "s5-p7-1": 7}, saved)
    assert out[0].prefixes == ROW and out[1].prefixes is None and saved == {7: []}


def test_the_resume_says_what_continues_and_what_is_generated_again(capsys):
    state = {"prefixes": {"7": [ROW]}, "regenerated": {"prompts": 1, "why": "not begun"}}
    assert inflight.on_resume(state, can=True) == {7: [ROW]}
    said = capsys.readouterr().out
    assert "resume: 1 prompts continue" in said and "(2 tokens kept); 1 generated again" in said
    assert inflight.on_resume(state, can=False) == {}
    assert "2 prompts in flight at the checkpoint are generated again" in capsys.readouterr().out
    assert inflight.on_resume({"epoch": 0}, can=True) == {}
    assert capsys.readouterr().out == ""


def test_a_dead_or_silent_engine_leaves_its_prompts_to_be_generated_again(monkeypatch):
    """The checkpoint is written whatever an engine does: a dead one (the run stopping
    because it died), one silent past the timeout and one without a push gate count as
    engines that could not hand their samples over."""
    from types import SimpleNamespace

    import ray

    def worker(answer):
        return SimpleNamespace(inflight_prefixes=SimpleNamespace(remote=lambda: answer))

    def get(ref, timeout):
        if isinstance(ref, BaseException):
            raise ref
        return ref

    monkeypatch.setattr(inflight, "ray", SimpleNamespace(get=get, exceptions=ray.exceptions))
    assert inflight.read_workers([worker({"g": ROW})]) == ({"g": ROW}, False)
    for bad in (ray.exceptions.RayActorError(), ray.exceptions.GetTimeoutError(), None):
        assert inflight.read_workers([worker({"g": ROW}), worker(bad)]) == ({"g": ROW}, True)


def test_the_first_take_waits_for_the_groups_saved_finished():
    done = [{**HALF, "done": True}, {**HALF, "done": True}]
    saved = {3: [done, ROW], 5: [ROW], 8: [done]}
    assert inflight.finished_positions(saved) == {3: 1, 8: 1}
