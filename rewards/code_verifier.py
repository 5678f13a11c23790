"""Built-in `code` reward: run the response's Python against the item's tests in a
sandbox (see rewards/sandbox.py for what the sandbox does and does not contain).

Tests come in the item's metadata, in one of two shapes:
- HumanEval: `test` (defines `check(candidate)`), `entry_point`, and optionally
  `code_prefix` (the function signature the completion continues). The solution is
  `code_prefix + code`; the tests are `test` followed by `check(entry_point)`.
- stdin/stdout: `inputs` and `outputs`, lists of equal length; a null input is an
  empty stdin (never the text "None"); outputs are compared after stripping trailing
  whitespace on each line.
The reward is 1.0 when every test passes, else 0.0.

A test passes only on evidence that it ran to its end, never on the exit status
alone: every run gets a fresh random marker (`secrets.token_hex`) that waits in a
pipe (rewards/sandbox.py `secret`), not in the program's text, and a harness prints
it only after the work is done. The verifier requires exit status 0, no timeout and
the marker exactly once on stdout:
- HumanEval: the harness runs the solution, then the tests and `check(...)`, then
  prints the marker. `sys.exit(0)`, `os._exit(0)`, `raise SystemExit`, an atexit
  handler, a killed process or closed stdout before `check` returns leave no marker.
  The program's own prints go to stderr. Before the tests run, the harness drops any
  trace/profile hook and gives the tests (and the candidate) the builtins as they were
  before the solution ran, so a solution that patches `abs` or `print` does not
  change what the tests compute; `exec`, `os.read` and `os.write` are held from the
  start.
- stdin/stdout: the harness runs the program and prints the marker when it ends
  normally or by `sys.exit()` / `sys.exit(0)` / `exit()`; `os._exit`, a signal or a
  non-zero exit leave none. The marker line is removed before the outputs are
  compared, so output printed after it (an atexit flush) still counts.

Limits: the harness shares the interpreter with the solution, so a solution written
against this harness can still cheat: read the marker's pipe itself (its descriptor
is in `sys.argv` before the harness takes it, and in /proc/self/fd), walk the
harness's frames, or race a thread against the tests. Return values that compare
equal to anything (`__eq__` always True) pass `assert candidate(x) == y` tests; the
tests decide what they check. What this stops is the cheap, generic way to score: end
the process early with status 0.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from .protocol import ScoreItem
from .sandbox import BwrapSandbox, Limits, NoSandbox, RunResult

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)

# The descriptor holding the marker is the last argument; the marker is read from it
# only once the work is done. Everything used after the solution runs is held in a
# local before it runs.
_HUMANEVAL_HARNESS = """\
import builtins, os, sys
def _posttrain_run(solution, tests):
    fd, out = int(sys.argv.pop()), os.dup(1)
    os.dup2(2, 1)
    run, read, write, settrace, setprofile = exec, os.read, os.write, sys.settrace, sys.setprofile
    clean = dict(vars(builtins))
    solution = compile(solution, "<solution>", "exec")
    tests = compile(tests, "<tests>", "exec")
    ns = {"__name__": "__main__", "__builtins__": builtins}
    run(solution, ns)
    settrace(None)
    setprofile(None)
    ns["__builtins__"] = clean
    run(tests, ns)
    write(out, b"\\n" + read(fd, 256) + b"\\n")
_posttrain_run(%r, %r)
"""

_STDIO_HARNESS = """\
import builtins, os, sys
def _posttrain_run(solution):
    fd, out = int(sys.argv.pop()), os.dup(1)
    run, read, write = exec, os.read, os.write
    solution = compile(solution, "<solution>", "exec")
    try:
        run(solution, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        if not (e.code is None or (isinstance(e.code, int) and e.code == 0)):
            raise
    for stream in (sys.stdout, sys.__stdout__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    write(out, b"\\n" + read(fd, 256) + b"\\n")
_posttrain_run(%r)
"""


def extract_code(response: str) -> str:
    """The last fenced code block of a response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _finished(res: RunResult, marker: str) -> str | None:
    """The run's stdout without its marker line if it ran to its end, else None."""
    line = f"\n{marker}\n"
    if res.timed_out or res.returncode != 0 or res.stdout.count(line) != 1:
        return None
    return res.stdout.replace(line, "", 1)


def _why(res: RunResult) -> str:
    if res.timed_out:
        return "timed out"
    if res.returncode == 0:
        return (
            "exited with status 0 before the tests finished (no completion marker)\n"
            + res.stderr[-240:]
        )
    return res.stderr[-300:]


def _run(
    sandbox: BwrapSandbox | NoSandbox, program: str, stdin: str | None, limits: Limits
) -> tuple[RunResult, str | None]:
    marker = secrets.token_hex(16)
    res = sandbox.run(program, stdin, limits, secret=marker.encode())
    return res, _finished(res, marker)


def score_code(
    item: ScoreItem, sandbox: BwrapSandbox | NoSandbox, limits: Limits
) -> tuple[float, dict[str, Any]]:
    """Score one item; details hold pass counts and the first failure's stderr tail.

    Raises:
        ValueError: the item's metadata has neither test shape (it cannot be scored).
    """
    meta, code = item.metadata, extract_code(item.response)
    if "test" in meta and "entry_point" in meta:
        solution = f"{meta.get('code_prefix', '')}{code}\n"
        tests = f"{meta['test']}\n\ncheck({meta['entry_point']})\n"
        res, out = _run(sandbox, _HUMANEVAL_HARNESS % (solution, tests), None, limits)
        ok = out is not None
        return (1.0 if ok else 0.0), {
            "passed": int(ok),
            "total": 1,
            "timed_out": res.timed_out,
            "stderr": "" if ok else _why(res),
        }
    if "inputs" in meta and "outputs" in meta:
        inputs, outputs = meta["inputs"], meta["outputs"]
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"item {item.uid}: inputs ({len(inputs)}) and outputs "
                f"({len(outputs)}) must be non-empty lists of equal length"
            )
        passed, first_err, program = 0, "", _STDIO_HARNESS % (code,)
        for stdin, want in zip(inputs, outputs, strict=True):
            res, out = _run(sandbox, program, "" if stdin is None else str(stdin), limits)
            if out is not None and _normalise(out) == _normalise(str(want)):
                passed += 1
            elif not first_err:
                first_err = _why(res) if out is None else "wrong output"
        return (1.0 if passed == len(inputs) else 0.0), {
            "passed": passed,
            "total": len(inputs),
            "stderr": first_err,
        }
    raise ValueError(
        f"item {item.uid}: the code reward needs metadata test + entry_point "
        "(HumanEval) or inputs + outputs (stdin/stdout)"
    )
