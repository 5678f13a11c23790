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

from posttrain.config import FileData, GeneratorData, RecipeError
from posttrain.recipes.chats import file_chats, tokenize_chat, tool_chats
from posttrain.recipes.cli import app
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


def test_row_without_assistant_turn_names_file_row_and_key(tmp_path):
    f = tmp_path / "chats.jsonl"
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=rf"{f}:2: key 'messages' has no assistant turn"):
        file_chats(FileData(path=str(f)))
    f.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(RecipeError, match=rf"{f}:1: no key 'messages'"):
        file_chats(FileData(path=str(f)))
    f.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(RecipeError, match=r"messages\[0\] must be"):
        file_chats(FileData(path=str(f)))


def test_parquet_rows_are_read(tmp_path):
    import datasets

    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"messages": CHAT}, {"messages": CHAT[:3]}]).save_to_disk(folder)
    got = file_chats(FileData(path=str(folder)))
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
    assert f"{data}:2: key 'messages' has no assistant turn" in out.output
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
