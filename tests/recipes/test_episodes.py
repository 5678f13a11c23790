"""Multi-turn episodes with a scripted engine (deterministic turns, so the tool path is
always exercised): token bookkeeping, loss masks, tools, truncation, and the train
batch's masks (single-turn unchanged)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from posttrain.actors.engine import Sample
from posttrain.actors.rollout import PromptRequest, Rollout, SamplingSettings
from posttrain.algorithms.batch import pack_rows
from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.grpo import GRPOLoss, loss
from posttrain.config.episodes import PythonTool
from posttrain.recipes.algo.rollouts import rollout_batch
from posttrain.recipes.episodes.multiturn import (
    TemplateMismatch,
    chat_ids,
    message_delta,
    run_episodes,
    start_episodes,
    to_rollout,
)
from posttrain.recipes.episodes.tools import (
    TRUNCATED_MARK,
    ToolEnvironment,
    make_tools,
    parse_tool_calls,
)
from tests.tiny_model import build_tiny_model

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>'
SAMPLING = SamplingSettings(n=1, max_new_tokens=200, seed=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", max_positions=1024)
    return AutoTokenizer.from_pretrained(folder)


class ScriptedEngine:
    """Answers the k-th call of episode `i` with `script[i][k]` (+ `<|im_end|>`), logprob
    -0.01 × (position + 1); records every prompt it was given."""

    def __init__(self, tok, script: list[list[str]], version: int = 3, cut: bool = False):
        self.tok, self.script, self.version, self.cut = tok, script, version, cut
        self.calls: list[list[list[int]]] = []
        self.turn = 0

    def __call__(self, prompts, sampling):
        self.calls.append(prompts)
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        out = []
        live = [i for i, s in enumerate(self.script) if len(s) > self.turn]
        for i, _ in zip(live, prompts, strict=True):
            ids = self.tok.encode(self.script[i][self.turn], add_special_tokens=False) + [eot]
            finish = "stop"
            if len(ids) > sampling.max_new_tokens:
                ids, finish = ids[: sampling.max_new_tokens], "length"
            out.append(Sample(ids, [-0.01 * (j + 1) for j in range(len(ids))], finish))
        self.turn += 1
        return out, self.version


def _episodes(tok, script, tools=None, max_turns=4, budget=2000, n=1):
    tools = tools if tools is not None else make_tools([PythonTool(name="python")], tok)
    req = PromptRequest("g0", [{"role": "user", "content": "What is 17*23?"}], "391")
    eps = start_episodes(tok, [req], n, lambda uid: ToolEnvironment(tools))
    engine = ScriptedEngine(tok, script)
    run_episodes(engine, tok, eps, SAMPLING, max_turns, budget)
    return eps, engine


def test_tool_turn_is_token_exact_and_masked(tok):
    eps, engine = _episodes(tok, [[f"Let me compute. {CALL}", "The answer is 391."]])
    e = eps[0]
    assert [t.role for t in e.turns] == ["assistant", "tool", "assistant"]
    assert [t.mask for t in e.turns] == [1, 0, 1]
    assert e.turns[1].text == "391\n"
    assert e.stats.tool_calls == 1 and e.stats.tool_errors == 0 and not e.truncated
    r = to_rollout(e, "prompt")
    # The second model turn was sampled from exactly prompt + turn 1 + tool delta.
    assert engine.calls[1][0] == r.prompt_ids + e.turns[0].ids + e.turns[1].ids
    # The char-level model sampled canonical ids: the trajectory is the template's
    # rendering of the whole conversation (less the "\n" after the final <|im_end|>).
    assert r.prompt_ids + r.response_ids == chat_ids(tok, e.messages, False)[:-1]
    assert r.loss_mask == [1] * len(e.turns[0].ids) + [0] * len(e.turns[1].ids) + [1] * len(
        e.turns[2].ids
    )
    model_lps = [lp for lp, m in zip(r.inference_logprobs, r.loss_mask, strict=True) if m]
    assert model_lps == e.turns[0].logprobs + e.turns[2].logprobs
    assert all(lp == 0.0 for lp, m in zip(r.inference_logprobs, r.loss_mask, strict=True) if not m)
    assert r.response_text == "The answer is 391." and r.finish_reason == "stop"
    tool_text = tok.decode(e.turns[1].ids)
    assert tool_text == "\n<|im_start|>tool\n391\n<|im_end|>\n<|im_start|>assistant\n"
    json.dumps(r.to_dict())  # the rollout file line


def test_malformed_and_unknown_calls_are_results_not_crashes(tok):
    bad = [
        '<tool_call>{"name": "python", "arguments": {"code": </tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}',
        "done",
    ]
    eps, _ = _episodes(tok, [bad], max_turns=4)
    e = eps[0]
    tool_texts = [t.text for t in e.turns if not t.mask]
    assert tool_texts[0].startswith("error: the tool call is not valid JSON")
    assert tool_texts[1].startswith("error: unknown tool 'calculator'")
    assert "without </tool_call>" in tool_texts[2]
    assert e.stats.tool_calls == 3 and e.stats.tool_errors == 3
    assert e.done and not e.truncated and e.turns[-1].text == "done"


def test_parse_tool_calls_forms():
    assert parse_tool_calls("no call") == []
    (c,) = parse_tool_calls(
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
    )
    assert c == {"name": "python", "arguments": {"code": "1"}}
    two = parse_tool_calls(CALL + " and " + CALL)
    assert len(two) == 2 and all(isinstance(x, dict) for x in two)


def test_failing_program_and_timeout_count_as_errors(tok):
    tools = make_tools([PythonTool(name="python", timeout_s=1.0)], tok)
    code = json.dumps({"name": "python", "arguments": {"code": "import time; time.sleep(5)"}})
    fail = json.dumps({"name": "python", "arguments": {"code": "1/0"}})
    eps, _ = _episodes(
        tok,
        [[f"<tool_call>{code}</tool_call>", f"<tool_call>{fail}</tool_call>", "ok"]],
        tools=tools,
    )
    texts = [t.text for t in eps[0].turns if not t.mask]
    assert texts[0] == "[timed out after 1 s]"
    assert "ZeroDivisionError" in texts[1]
    assert eps[0].stats.tool_errors == 2 and eps[0].stats.tool_time_s > 0


def test_output_cap_marks_the_cut(tok):
    tools = make_tools([PythonTool(name="python", max_output_tokens=10)], tok)
    code = json.dumps({"name": "python", "arguments": {"code": "print('x' * 50)"}})
    eps, _ = _episodes(tok, [[f"<tool_call>{code}</tool_call>", "ok"]], tools=tools)
    assert eps[0].turns[1].text == "x" * 10 + TRUNCATED_MARK  # char tokenizer: 10 tokens


def test_max_turns_and_token_budget_truncate(tok):
    eps, engine = _episodes(tok, [[CALL, CALL, CALL]], max_turns=2)
    e = eps[0]
    assert e.model_turns == 2 and e.truncated and len(engine.calls) == 2
    assert e.turns[-1].mask == 1  # the last call's result is not appended
    assert to_rollout(e, "").finish_reason == "length"
    # A budget that the first tool result does not fit in.
    first = len(tok.encode(CALL)) + 1
    eps, engine = _episodes(tok, [[CALL, "ok"]], budget=first + 5)
    assert eps[0].truncated and len(eps[0].turns) == 1 and len(engine.calls) == 1
    # A budget that cuts the second model turn: that turn samples only what is left.
    tool = len(_episodes(tok, [[CALL, "ok"]])[0][0].turns[1].ids)
    eps, engine = _episodes(tok, [[CALL, "a long final answer"]], budget=first + tool + 8)
    e = eps[0]
    assert e.truncated and e.response_len == first + tool + 8 and e.turns[-1].mask == 1
    assert len(e.turns[-1].ids) == 8


def test_template_that_rewrites_history_is_refused(tok):
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    # Like templates that drop earlier turns' reasoning: earlier assistant turns change.
    tok2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}X{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    eot = tok2.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(TemplateMismatch, match="renders the conversation differently"):
        message_delta(tok2, history, [{"role": "tool", "content": "1"}], eot, eot)


def test_stop_string_turn_gets_the_templates_closing(tok):
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a."}]
    new = [{"role": "tool", "content": "1"}]
    last = tok.convert_tokens_to_ids(".")  # a stop string ended the turn, not <|im_end|>
    delta = message_delta(tok, history, new, last, eot)
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"


def _rollout(resp, mask=None):
    return Rollout(
        uid="u",
        group_id="g",
        prompt_ids=[5, 6],
        response_ids=resp,
        inference_logprobs=[-0.5] * len(resp),
        finish_reason="stop",
        policy_version=0,
        prompt_text="",
        response_text="",
        loss_mask=mask,
    )


def test_batch_masks_environment_tokens_and_single_turn_is_unchanged():
    single = [_rollout([7, 8, 9]), _rollout([7])]
    batch = rollout_batch(single, [1.0, 0.0], pad_id=0)
    ids, attn, resp, start = pack_rows([(r.prompt_ids, r.response_ids) for r in single], 0)
    assert torch.equal(batch.response_mask, resp) and torch.equal(batch.input_ids, ids)
    multi = rollout_batch([_rollout([7, 8, 9, 10], [1, 0, 0, 1]), _rollout([7])], [1.0, 0.0], 0)
    assert multi.response_mask.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0]]
    assert loss_denominator(multi.response_mask, "token_mean") == 3.0


def test_loss_ignores_environment_tokens():
    """Changing logprobs or advantages on masked (environment) columns changes nothing."""
    b = rollout_batch([_rollout([7, 8, 9, 10], [1, 0, 0, 1])], [1.0], 0)
    b.advantages = torch.full(b.input_ids.shape, 0.7) * b.response_mask
    b.loss_denominator = float(b.response_mask.sum())
    b.old_logprobs = torch.full(b.input_ids.shape, -1.0)
    lp = torch.full(b.input_ids.shape, -0.9)
    base = loss(lp, b, GRPOLoss())
    env = b.response_mask == 0
    lp2 = torch.where(env, torch.full_like(lp, -9.0), lp)
    b.advantages = torch.where(env, torch.full_like(lp, 5.0), b.advantages)
    other = loss(lp2, b, GRPOLoss())
    assert float(base.loss) == pytest.approx(float(other.loss), abs=0)
    assert base.sums["tokens"] == other.sums["tokens"] == 2.0
    # Hand value: ratio e^{0.1} clipped at 1.2? e^0.1 = 1.105 < 1.2, so -A·ratio per token.
    assert float(base.loss) == pytest.approx(-0.7 * torch.exp(torch.tensor(0.1)).item(), abs=1e-6)


def test_groups_of_episodes(tok):
    eps, _ = _episodes(tok, [[CALL, "a"], ["b"]], n=2)
    assert [e.uid for e in eps] == ["g0-0", "g0-1"]
    assert [e.model_turns for e in eps] == [2, 1]


def _bpe_tokenizer(template: str):
    """A BPE tokenizer whose only merge is "1" + "2" -> "12"."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .=?\n:")
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *chars, "12"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    t.chat_template = template
    return t


def test_retokenising_would_change_the_sampled_ids(tok):
    """Within a turn: the model sampled "1" then "2" (two tokens); the text re-tokenised
    is one "12" token, so the learner would train on ids (and positions) the policy
    never produced. The episode keeps the sampled ids."""
    from tests.tiny_model import CHAT_TEMPLATE

    bpe = _bpe_tokenizer(CHAT_TEMPLATE)
    one, two, eot = (bpe.convert_tokens_to_ids(x) for x in ("1", "2", "<|im_end|>"))
    req = PromptRequest("g", [{"role": "user", "content": "x?"}])
    eps = start_episodes(bpe, [req], 1, lambda uid: ToolEnvironment({}))

    def engine(prompts, sampling):
        return [Sample([one, two, eot], [-0.1, -0.2, -0.3], "stop")], 0

    run_episodes(engine, bpe, eps, SAMPLING, 2, 100)
    r = to_rollout(eps[0], "")
    assert r.response_ids == [one, two, eot]
    retok = bpe.encode(bpe.decode(r.prompt_ids + r.response_ids), add_special_tokens=False)
    assert retok != r.prompt_ids + r.response_ids
    assert len(retok) == len(r.prompt_ids) + 2  # "12" merged: the masks would shift


def test_merge_across_a_turn_boundary_is_refused_not_retokenised():
    """A template with nothing between turns: the model's turn ends in "1" (a stop
    string), the tool result starts with "2". Rendering the text again merges "12" across
    the boundary; `message_delta` refuses instead of changing the model's ids."""
    bpe = _bpe_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    history = [{"role": "user", "content": "q "}, {"role": "assistant", "content": "a1"}]
    new = [{"role": "tool", "content": "2"}]
    sampled = bpe.encode("q a1", add_special_tokens=False)
    rendered = bpe.encode("q a12", add_special_tokens=False)
    assert rendered[: len(sampled)] != sampled  # the boundary merge
    with pytest.raises(TemplateMismatch):
        message_delta(bpe, history, new, bpe.convert_tokens_to_ids("1"), None)


def _recipe(**rollout):
    from posttrain.config import Recipe

    algo = rollout.pop("algorithm", "grpo")
    grpo = rollout.pop("grpo", {})
    return Recipe.model_validate(
        {
            "name": "x",
            "algorithm": algo,
            "model": {"path": "m"},
            "data": {"train": {"generator": "arithmetic", "size": 4}},
            "rollout": {"engine": "hf", "samples_per_prompt": 2, **rollout},
            "grpo": grpo,
            "rewards": [{"name": "c", "type": "math"}],
            "train": {"steps": 1, "prompts_per_step": 1},
        }
    )


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"tools": [{"name": "python"}]}, "set rollout.max_turns: 2 or more"),
        ({"max_turns": 3, "algorithm": "distill"}, "set algorithm: grpo or algorithm: ppo"),
        (
            {
                "max_turns": 3,
                "tools": [{"name": "python"}],
                "environment": {"type": "python", "class_path": "a:B"},
            },
            "keep one",
        ),
        (
            {"agent": {"command": ["x"]}, "tools": [{"name": "python"}], "max_turns": 2},
            "drives its own episodes",
        ),
        (
            {"max_turns": 2, "max_new_tokens": 64, "grpo": {"overlong_buffer": 16}},
            "remove grpo.overlong_buffer",
        ),
        # the agent's own requests carry these: the recipe's were ignored without a word
        ({"agent": {"command": ["x"]}, "stop": ["\n"]}, "rollout.stop is not read by"),
        (
            {"agent": {"command": ["x"]}, "max_episode_tokens": 64},
            "rollout.max_episode_tokens is not read by",
        ),
    ],
)
def test_schema_refuses_inconsistent_episode_settings(rollout, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        _recipe(**rollout)


def test_single_turn_defaults_stay_single_turn():
    r = _recipe()
    assert r.rollout.max_turns == 1 and not r.rollout.tools and r.rollout.environment is None
    from posttrain.recipes.episodes.step import episodes_enabled

    assert not episodes_enabled(r) and episodes_enabled(_recipe(agent={"command": ["a"]}))
