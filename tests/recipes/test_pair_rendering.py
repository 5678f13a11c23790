"""Preference pairs are rendered one way everywhere: DPO trains on the token ids the
reward model trains on, and both equal what the reward service feeds a reward model
for the same conversation and reply (the chat template: an hh dialogue split into its
user / assistant turns, the reply as the assistant's next turn up to its end of turn).
Before 2026-12-01 DPO read hh pairs as raw `Human: ... Assistant:` text."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import yaml
from transformers import AutoTokenizer

from posttrain.common.chat_tokens import chat_prompt, chat_reply, stop_ids
from posttrain.recipes.algo.dpo import DPO
from posttrain.recipes.algo.reward_model import RewardModel
from posttrain.recipes.assess.scoring import bootstrap_ci
from posttrain.recipes.data.pairs import hh_messages, load_pairs
from posttrain.recipes.loading import load_recipe

HH = [
    {
        "chosen": "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour and water.",
        "rejected": "\n\nHuman: How do I bake bread?\n\nAssistant: No idea.",
    },
    {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: "
        "Why did the chicken cross the road?",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No.",
    },
]


def _algo(cls, tmp_path, tiny_model, data, algorithm, block):
    f = tmp_path / f"{algorithm}.yaml"
    tree = {
        "name": algorithm,
        "algorithm": algorithm,
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": {"path": str(data), "format": "hh"}},
        algorithm: block,
        "train": {"steps": 1, "prompts_per_step": 1},
    }
    f.write_text(yaml.safe_dump(tree))
    algo = cls(load_recipe(f))
    algo.prepare(SimpleNamespace(model_path=str(tiny_model), data=load_pairs(data, "hh")[0]))
    return algo


def test_dpo_reward_model_and_reward_service_render_hh_pairs_alike(tiny_model, tmp_path):
    data = tmp_path / "hh.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in HH))
    dpo = _algo(DPO, tmp_path, tiny_model, data, "dpo", {"precompute_ref_logprobs": False})
    rm = _algo(RewardModel, tmp_path, tiny_model, data, "reward_model", {"max_length": 512})
    assert dpo.pairs == rm.pairs  # same ids, same order (no pair dropped)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for row, pair in zip(HH, dpo.pairs, strict=True):
        cut = row["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")
        messages = hh_messages(row["chosen"][:cut])
        prompt, text = chat_prompt(tok, messages)  # as rewards/reward_model.py renders
        reply = chat_reply(tok, messages, text, row["chosen"][cut:].strip(), stop_ids(tok))
        assert pair.prompt_ids == prompt and pair.chosen_ids == reply
    assert dpo.template_id == "chat-template-v1"


def test_dpo_chat_template_off_keeps_raw_text(tiny_model, tmp_path):
    data = tmp_path / "hh.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in HH))
    block = {"precompute_ref_logprobs": False, "chat_template": False}
    dpo = _algo(DPO, tmp_path, tiny_model, data, "dpo", block)
    assert dpo.template_id.startswith("plain-text")


def test_bootstrap_interval_hand_values():
    assert bootstrap_ci([1.0] * 5) == (1.0, 1.0)
    lo, hi = bootstrap_ci([0.0, 1.0] * 100, reps=2000, seed=0)
    # mean 0.5, standard error 0.5 / sqrt(200) = 0.0354: the 95% interval is ±0.069
    assert lo == pytest.approx(0.5 - 0.069, abs=0.012) and hi == pytest.approx(
        0.5 + 0.069, abs=0.012
    )
    with pytest.raises(ValueError):
        bootstrap_ci([])


# A generation prompt that opens the reply with `<think>` (DeepSeek-R1's, Qwen3's kind).
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


def test_a_generation_prompt_opening_think_is_neither_doubled_nor_added(tiny_model):
    # issue 47: prompt + chosen rendered `<think><think>2+2=4</think>...` and the
    # rejected reply gained a `<think>` it never had
    from posttrain.recipes.data.pair_tokens import tokenize_pairs_with_template
    from posttrain.recipes.data.pairs import PreferencePair

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = THINK_TEMPLATE
    prompt = [{"role": "user", "content": "2+2?"}]
    pair = PreferencePair(0, prompt, "<think>2+2=4</think>It is 4.", "It is 5.")
    [t] = tokenize_pairs_with_template([pair], tok, max_length=256).pairs
    assert tok.decode(t.prompt_ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(t.chosen_ids) == "<think>2+2=4</think>It is 4.<|im_end|>"
    assert tok.decode(t.rejected_ids) == "It is 5.<|im_end|>"
    for reply, ids in ((pair.chosen, t.chosen_ids), (pair.rejected, t.rejected_ids)):
        full = tok.apply_chat_template(
            prompt + [{"role": "assistant", "content": reply}], tokenize=True, return_dict=True
        )["input_ids"]
        assert t.prompt_ids + ids == full[:-1]  # the whole conversation, less the last "\n"
