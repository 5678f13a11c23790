"""Built-in `code` reward: run the response's Python against the item's tests in a
sandbox (see rewards/sandbox.py for what the sandbox does and does not contain).

Tests come in the item's metadata, in one of two shapes:
- HumanEval: `test` (defines `check(candidate)`), `entry_point`, and optionally
  `code_prefix` (the function signature the completion continues). The program is
  `code_prefix + code + test + check(entry_point)`.
- stdin/stdout: `inputs` and `outputs`, lists of equal length; a null input is an
  empty stdin (never the text "None"); outputs are compared after stripping trailing
  whitespace on each line.
The reward is 1.0 when every test passes, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.sandbox import BwrapSandbox, Limits, NoSandbox

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of a response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def score_code(
    item: ScoreItem, sandbox: BwrapSandbox | NoSandbox, limits: Limits
) -> tuple[float, dict[str, Any]]:
    """Score one item; details hold pass counts and the first failure's stderr tail.

    Raises:
        ValueError: the item's metadata has neither test shape (it cannot be scored).
    """
    meta, code = item.metadata, extract_code(item.response)
    if "test" in meta and "entry_point" in meta:
        program = (f"{meta.get('code_prefix', '')}{code}\n\n{meta['test']}\n\n"
                   f"check({meta['entry_point']})\n")
        res = sandbox.run(program, None, limits)
        return (1.0 if res.ok else 0.0), {
            "passed": int(res.ok), "total": 1, "timed_out": res.timed_out,
            "stderr": res.stderr[-300:]}
    if "inputs" in meta and "outputs" in meta:
        inputs, outputs = meta["inputs"], meta["outputs"]
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(f"item {item.uid}: inputs ({len(inputs)}) and outputs "
                             f"({len(outputs)}) must be non-empty lists of equal length")
        passed, first_err = 0, ""
        for stdin, want in zip(inputs, outputs, strict=True):
            res = sandbox.run(code, "" if stdin is None else str(stdin), limits)
            if res.ok and _normalise(res.stdout) == _normalise(str(want)):
                passed += 1
            elif not first_err:
                first_err = "timed out" if res.timed_out else res.stderr[-300:]
        return (1.0 if passed == len(inputs) else 0.0), {
            "passed": passed, "total": len(inputs), "stderr": first_err}
    raise ValueError(f"item {item.uid}: the code reward needs metadata test + entry_point "
                     "(HumanEval) or inputs + outputs (stdin/stdout)")
