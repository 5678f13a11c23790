"""docs/service.md's SDK example runs as written (its model renamed to the tiny one)."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.service.conftest import TOKEN

pytest.importorskip("tinker")


def test_the_docs_example_runs(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "docs" / "service.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 15
    monkeypatch.setenv("TINKER_BASE_URL", served.url)
    monkeypatch.setenv("TINKER_API_KEY", TOKEN)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("smollm2-135m-instruct", "tiny"), {})  # noqa: S102
    lines = out.getvalue().splitlines()
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert losses[-1] < losses[0]
    assert os.environ["TINKER_API_KEY"] == TOKEN and len(lines) == 6
