"""The controller's unit of training data, `PromptItem`, and the JSON-lines reader every
data source shares. Imports nothing of the control plane, so the prompt and the
preference readers both build on it without importing each other."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RecipeError


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the training set.

    Attributes:
        prompt_id: stable id within the data set (row index or generator index).
        question: the user message sent to the policy.
        ground_truth: reference answer the verifier compares against (text).
        metadata: anything else from the source row, passed to reward services.
    """

    prompt_id: int
    question: str
    ground_truth: str
    metadata: dict[str, Any] = field(default_factory=dict)


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """`(line number, parsed row)` of a .jsonl or .jsonl.gz file, blank lines skipped.

    Raises:
        RecipeError: unreadable file (not gzip, not UTF-8, I/O) or a line that is not
            JSON; names the file (and line).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecipeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise RecipeError(
            f"{path}: cannot read it as UTF-8 JSON lines"
            f"{' (gzip)' if opener is gzip.open else ''}: {e}"
        ) from None
