"""SFT conversations: the assistant mask on multi-turn chats (system, user, assistant,
tool turns) from the chat template, by prefix rendering and by `{% generation %}`
markers; refusals naming file, row and key; the tool_chats generator's format."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from transformers import AutoTokenizer
from typer.testing import CliRunner

from posttrain.config import FileData, GeneratorData, MixtureData, RecipeError
from posttrain.recipes.cli import app
from posttrain.recipes.data.chats import tokenize_chat
from posttrain.recipes.data.generators import tool_chats
from posttrain.recipes.data.sources import items_of
from posttrain.recipes.episodes.tools import parse_tool_calls

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2*3?"},
    {"role": "assistant", "content": "call"},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "ok!"},
]
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _masked_text(tok, t):
    """The masked tokens as text, one string per run of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(t.ids, t.mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_mask_covers_every_assistant_turn_and_nothing_else(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    t = tokenize_chat(tok, CHAT, "row 1")
    assert t.ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    # each assistant reply with the template's end of turn, in order; system, user and
    # tool turns and the role headers are context
    assert _masked_text(tok, t) == ["call<|im_end|>\n", "6<|im_end|>\n", "ok!<|im_end|>\n"]
    assert sum(t.mask) == (4 + 2) + (1 + 2) + (3 + 2)  # reply + <|im_end|> + newline


def test_generation_markers_give_the_same_mask(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = tokenize_chat(tok, CHAT, "row 1")
    tok.chat_template = GENERATION_TEMPLATE
    marked = tokenize_chat(tok, CHAT, "row 1")
    assert marked.ids == plain.ids and marked.mask == plain.mask


def test_a_template_that_cannot_mark_assistant_tokens_is_refused(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # renders the number of messages first: earlier turns change once more follow
    tok.chat_template = "{{ messages | length }}" + tok.chat_template
    with pytest.raises(RecipeError, match=r"data.jsonl:3: the chat template cannot mark"):
        tokenize_chat(tok, CHAT, "data.jsonl:3")
    tok.chat_template = None
    with pytest.raises(RecipeError, match="no chat template"):
        tokenize_chat(tok, CHAT, "data.jsonl:3")


def test_a_generation_prompt_opening_think_masks_the_reply_as_rendered(tiny_model):
    # issue 47's sibling: the generation prompt ends in `<think>`, so the reply's turn
    # leaves it inside the generation prompt; the mask starts there (this was refused)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>{% endif %}"
    )
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>add</think>4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    t = tokenize_chat(tok, chat, "row 1")
    assert t.ids == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    # the `<think>` the generation prompt writes is context (the policy never samples it)
    assert _masked_text(tok, t) == ["add</think>4<|im_end|>\n", "6<|im_end|>\n"]


# What a Qwen3 template does with an assistant turn: its `reasoning_content` in a think
# block (an empty one without it), then the content.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "<think>\n{{ m.reasoning_content if m.reasoning_content is defined else '' }}"
    "\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_content_reaches_the_template(tiny_model, tmp_path):
    # issue 47: check_messages kept role and content only, so this row trained
    # `<think>\n\n</think>\n\n4` instead of `<think>\nadd\n</think>\n\n4`
    f = tmp_path / "chats.jsonl"
    turn = {"role": "assistant", "content": "4", "reasoning_content": "add", "tool_calls": None}
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}, turn]}) + "\n")
    [chat] = items_of(FileData(path=str(f)), "chats")[0]
    assert chat.messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "add"}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = QWEN3_LIKE
    t = tokenize_chat(tok, chat.messages, chat.origin)
    masked = [i for i, m in zip(t.ids, t.mask, strict=True) if m]
    want = "<think>\nadd\n</think>\n\n4<|im_end|>\n"
    # the tiny tokenizer has one token per character and reads "\n\n" as one <unk>
    assert "".join(tok.convert_ids_to_tokens(masked)) == want.replace("\n\n", "<unk>")


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"weight": 0}, r"message 2 has key 'weight', which posttrain does not pass"),
        ({"reasoning_content": 5}, r"message 2 key 'reasoning_content' is 5, not text"),
        ({"tool_calls": "x"}, r"message 2 key 'tool_calls' is \"x\", not a list"),
    ],
)
def test_message_keys_a_template_cannot_take_are_refused(tmp_path, extra, match):
    f = tmp_path / "chats.jsonl"
    turn = {"role": "assistant", "content": "4", **extra}
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}, turn]}) + "\n")
    with pytest.raises(RecipeError, match=rf"{f}:1: 'messages' {match}"):
        items_of(FileData(path=str(f)), "chats")[0]


def test_row_without_assistant_turn_names_file_row_and_key(tmp_path):
    f = tmp_path / "chats.jsonl"
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=rf"{f}:2: 'messages' has no assistant turn"):
        items_of(FileData(path=str(f)), "chats")[0]
    f.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(RecipeError, match=rf"{f}:1: no key 'messages'"):
        items_of(FileData(path=str(f)), "chats")[0]
    f.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(RecipeError, match=r":1: 'messages' message 1 has role \"bot\""):
        items_of(FileData(path=str(f)), "chats")[0]


def test_parquet_rows_are_read(tmp_path):
    import datasets

    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"messages": CHAT}, {"messages": CHAT[:3]}]).save_to_disk(folder)
    got = items_of(FileData(path=str(folder)), "chats")[0]
    assert [len(c.messages) for c in got] == [7, 3]


def test_tool_chats_call_the_tool_as_the_tool_parser_reads_it():
    cfg = GeneratorData(generator="tool_chats", size=3, min_digits=2, max_digits=3, operators=["*"])
    chats = tool_chats(cfg, "SYSTEM")
    m = chats[0].messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant"]
    assert m[0]["content"] == "SYSTEM" and m[1]["content"] == "Calculate 41 * 265."
    (call,) = parse_tool_calls(m[2]["content"])
    assert call == {"name": "python", "arguments": {"code": "print(41 * 265)"}}
    assert m[3]["content"] == "10865\n" and m[4]["content"] == "10865"


def _recipe(tmp_path, model, data):
    f = tmp_path / "sft.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "sft",
                "algorithm": "sft",
                "model": {"path": str(model), "dtype": "float32"},
                "data": {"train": {"path": str(data)}},
                "train": {"steps": 1, "prompts_per_step": 2},
            }
        )
    )
    return f


def test_cli_exits_2_on_a_row_without_assistant_turn_and_on_a_bad_template(tiny_model, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    cli = CliRunner()
    ok = cli.invoke(app, ["validate", str(_recipe(tmp_path, tiny_model, data))])
    assert ok.exit_code == 0, ok.output
    assert "1 conversations" in ok.output
    data.write_text(data.read_text() + json.dumps({"messages": CHAT[:2]}) + "\n")
    out = cli.invoke(app, ["validate", str(_recipe(tmp_path, tiny_model, data))])
    assert out.exit_code == 2
    assert f"{data}:2: 'messages' has no assistant turn" in out.output
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    tok = AutoTokenizer.from_pretrained(broken)
    tok.chat_template = "{{ messages | length }}" + tok.chat_template
    tok.save_pretrained(broken)
    out = cli.invoke(app, ["validate", str(_recipe(tmp_path, broken, data))])
    assert out.exit_code == 2
    assert f"{data}:1: the chat template cannot mark assistant tokens" in out.output


def test_the_run_summary_of_sft_names_its_losses(tmp_path, capsys):
    from posttrain.recipes.monitoring.summary import print_summary as _summary

    hist = [
        {"loss": 0.5, "sft/assistant_tokens": 10.0},
        {"loss": 0.1, "sft/assistant_tokens": 10.0, "eval/loss": 0.2},
    ]
    _summary(hist, tmp_path, 3.0)  # raised KeyError 'time/generate' before
    assert "loss 0.5000 → 0.1000   held-out loss 0.2000" in capsys.readouterr().out


def test_a_generator_of_another_kind_is_refused():
    # the old prompt loader answered tool_chats with arithmetic prompts, silently
    with pytest.raises(RecipeError, match="data.train: tool_chats makes chats, and this"):
        items_of(GeneratorData(generator="tool_chats", size=2), "prompts")
    with pytest.raises(RecipeError, match="data.train.mixture.0: arithmetic makes prompts"):
        items_of(MixtureData.model_validate({"mixture": [{"generator": "arithmetic"}]}), "chats")
