"""MCP tools of an OpenEnv environment (`mcp_tools: true`): the example game's `compare`
tool listed at reset into the system message, a model turn's `<tool_call>` sent as a
`call_tool` step whose result comes back as a `tool` message, token-exact with the
environment's tokens masked; bad calls give the model an error text; tools or results
posttrain cannot use (or too big, or a non-finite reward) fail the episode, not the
step. A scripted engine on the tiny model's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.episodes import OpenEnvEnvironment
from posttrain.recipes.episodes.multiturn import to_rollout
from tests.hostile_servers import serve_app
from tests.recipes.test_openenv import _group_for, _run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import openenv_game  # noqa: E402

CALL = '<tool_call>{"name": "compare", "arguments": {"number": %s}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("t") / "m"))


def _config(url: str, transport: str = "websocket") -> OpenEnvEnvironment:
    return OpenEnvEnvironment(
        type="openenv",
        url=url,
        transport=transport,
        observation_key="feedback",
        mcp_tools=True,
        retries=0,
        timeout_s=5,
    )


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_a_tool_call_is_a_call_tool_step_and_its_result_a_tool_message(tok, transport):
    with serve_app(openenv_game.create_app()) as url:
        eps, engine = _run(
            tok, _config(url, transport), [_group_for(37)], [CALL % 50, "I say 37", "x"]
        )
    e = eps[0]
    assert e.error is None and e.done and e.env_reward == 1.0 and e.stats.tool_calls == 1
    assert [t.role for t in e.turns] == ["assistant", "tool", "assistant"]
    assert e.turns[1].text == "50 is greater than the secret number."
    # the tools were shown in the system message, which was rendered into the prompt
    prompt = tok.decode(engine.calls[0][0][0])
    assert "- compare: Says whether a number" in prompt and '"required": ["number"]' in prompt
    assert prompt.index("<tool_call>") < prompt.index("Guess my number.")
    # token-exact: model turns are the engine's ids, the tool message's tokens masked
    r = to_rollout(e, "")
    sampled = [i for t in e.turns if t.mask for i in t.ids]
    assert [i for i, m in zip(r.response_ids, r.loss_mask, strict=True) if m] == sampled
    assert e.turns[0].ids == engine.calls[0][1][0].token_ids
    assert sum(1 - m for m in r.loss_mask) == len(e.turns[1].ids) > 0


def test_bad_calls_give_the_model_an_error_and_the_episode_goes_on(tok):
    bad = [
        '<tool_call>{"name": "peek", "arguments": {}}</tool_call>',  # not listed
        CALL % '"fifty"',  # the server answers with an error
        "<tool_call>{not json}</tool_call>",
    ]
    with serve_app(openenv_game.create_app()) as url:
        eps, _ = _run(tok, _config(url), [_group_for(37)], [*bad, "37"], max_turns=4)
    e = eps[0]
    assert e.error is None and e.done and e.env_reward == 1.0
    assert e.stats.tool_calls == 3 and e.stats.tool_errors == 3
    texts = [t.text for t in e.turns if t.role == "tool"]
    assert "unknown tool 'peek'; available: compare" in texts[0]
    assert texts[1] == "error (invalid_args): number: an integer"
    assert "not valid JSON" in texts[2]


class _Listing(openenv_game.GuessEnvironment):
    """A game whose MCP answers are set per test class attribute."""

    tools: Any = [openenv_game.COMPARE]
    result: Any = None
    reward: Any = None

    def mcp(self, action):
        if action["type"] == "list_tools":
            return {"observation": {"tools": self.tools}, "reward": None, "done": False}
        obs = {"tool_name": "compare", "result": self.result, "error": None}
        return {"observation": obs, "reward": self.reward, "done": False}


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ({"tools": []}, "listed no tools"),
        ({"tools": [{"description": "no name"}]}, "a tool of the wrong shape"),
        ({"tools": "compare"}, "without a tools list"),
        ({"result": {"content": [{"type": "image", "data": "..."}]}}, "['image']"),
        ({"result": "x" * 20_000}, "exceeds limit of 10000 bytes"),  # max_message_bytes
        ({"reward": float("nan")}, "finite"),
    ],
)
def test_tools_or_results_it_cannot_use_fail_the_episode_not_the_step(tok, fault, says):
    with serve_app(openenv_game.create_app(type("Env", (_Listing,), fault))) as url:
        cfg = _config(url).model_copy(update={"max_message_bytes": 10_000})
        eps, _ = _run(tok, cfg, [_group_for(37)], [CALL % 50, "37"], max_turns=2)
    assert eps[0].done and eps[0].error is not None and says in eps[0].error, eps[0].error


def test_a_server_without_mcp_still_plays_turns_without_calls(tok):
    """mcp_tools off (the default): a turn that looks like a call is the ordinary action."""
    cfg = _config("http://unused").model_copy(update={"mcp_tools": False})
    with serve_app(openenv_game.create_app()) as url:
        eps, _ = _run(tok, cfg.model_copy(update={"url": url}), [_group_for(37)], [CALL % 37])
    assert eps[0].done and eps[0].env_reward == 1.0 and eps[0].stats.tool_calls == 0
