"""Preference pairs for DPO: loading (jsonl or gzip jsonl, two formats) and
tokenisation into paired rows.

Formats:
- `pairs`: each row has `prompt`, `chosen`, `rejected` (keys configurable); the
  replies are the text after the prompt.
- `hh`: Anthropic HH-RLHF rows `{"chosen", "rejected"}`, each a whole dialogue of
  `\\n\\nHuman: …\\n\\nAssistant: …` turns sharing every turn but the last reply. The
  prompt is the dialogue up to and including the last `\\n\\nAssistant:`; rows whose
  two dialogues do not share that prompt are skipped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.recipes.data import jsonl_rows
from posttrain.config import RecipeError

HH_MARK = "\n\nAssistant:"


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: the same prompt, a preferred and a dispreferred reply (text)."""

    pair_id: int
    prompt: str
    chosen: str
    rejected: str


def load_pairs(path: str | Path, fmt: str, prompt_key: str = "prompt",
               chosen_key: str = "chosen", rejected_key: str = "rejected",
               limit: int | None = None) -> tuple[list[PreferencePair], int]:
    """Pairs of a data file and how many rows were skipped (hh rows that do not split).

    Raises:
        RecipeError: unreadable rows, missing or non-text keys, or no usable pair;
            names file, line and key.
    """
    path = Path(path)
    keys = [chosen_key, rejected_key] + ([prompt_key] if fmt == "pairs" else [])
    pairs, skipped = [], 0
    for lineno, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise RecipeError(f"{path}:{lineno}: a row must be a JSON object")
        for k in keys:
            if not isinstance(row.get(k), str):
                what = "is missing" if k not in row else f"is {json.dumps(row[k])[:30]}, not text"
                raise RecipeError(f"{path}:{lineno}: key {k!r} {what}; the row's keys are "
                                  f"{sorted(row)} (see data.train.*_key, data.train.format)")
        if fmt == "hh":
            cut = row[chosen_key].rfind(HH_MARK)
            prompt = row[chosen_key][: cut + len(HH_MARK)] if cut >= 0 else ""
            if not prompt or not row[rejected_key].startswith(prompt):
                skipped += 1
                continue
            chosen, rejected = row[chosen_key][len(prompt):], row[rejected_key][len(prompt):]
        else:
            prompt, chosen, rejected = row[prompt_key], row[chosen_key], row[rejected_key]
        pairs.append(PreferencePair(len(pairs), prompt, chosen, rejected))
        if limit and len(pairs) >= limit:
            break
    if not pairs:
        why = (f"; {skipped} hh rows skipped: no '\\n\\nAssistant:' turn shared by chosen and "
               "rejected" if skipped else "")
        raise RecipeError(f"{path}: no usable preference pairs{why}")
    return pairs, skipped


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of one pair: `[P]` prompt, `[Rc]` chosen and `[Rr]` rejected replies
    (each reply ending with EOS)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def tokenize_pairs(pairs: list[PreferencePair], tokenizer: Any,
                   max_length: int) -> list[TokenizedPair]:
    """Plain-text tokenisation (no chat template), replies end with EOS. A pair longer
    than `max_length` keeps the end of its prompt and the start of its replies, with
    the prompt never shorter than half of `max_length` (TRL's keep_end/keep_start)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for p in pairs:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        replies = [tokenizer(r, add_special_tokens=False)["input_ids"] + eos
                   for r in (p.chosen, p.rejected)]
        longest = max(len(r) for r in replies)
        if len(prompt) + longest > max_length:
            keep_prompt = max(max_length - longest, max_length // 2)
            prompt = prompt[-keep_prompt:]
            replies = [r[: max_length - len(prompt)] for r in replies]
        out.append(TokenizedPair(prompt, replies[0], replies[1]))
    return out
