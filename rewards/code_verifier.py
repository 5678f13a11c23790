"""Built-in `code` reward: run the response's Python against the item's tests in a
sandbox (see rewards/sandbox.py for what the sandbox does and does not contain).

Tests come in the item's metadata, in one of two shapes:
- HumanEval: `test` (defines `check(candidate)`), `entry_point`, and optionally
  `code_prefix` (the function signature the completion continues). The solution is
  `code_prefix + code`; the tests are `test` followed by `check(entry_point)`.
- stdin/stdout: `inputs` and `outputs`, lists of equal length; a null input is an
  empty stdin (never the text "None"). Outputs are compared after stripping trailing
  whitespace on each line (and blank lines at either end), line by line and token by
  token (a token is a run of non-space characters; the spaces between tokens must match
  too). Two tokens match when their text is equal, or, as competitive judges compare
  real numbers, when the expected token is a decimal with a point or an exponent
  (`0.5`, `.5`, `-2.000`, `3e-7`; not `nan` or `inf`), the printed one is a decimal
  number too (`2` may answer `2.000`), and they differ by at most `tolerance`
  absolutely or relatively: |got - want| <= tolerance * max(1, |want|). The default
  tolerance is 1e-6 (the code reward's `float_tolerance`): expected `0.333333` accepts
  `0.3333333333` but not `0.3333`. An expected integer (`42`, `-7`) must be printed as
  that text exactly (`42.0` fails), whatever its length: no int() on our side, so no
  digit limit. A tolerance of 0 compares every token as text.
The reward is 1.0 when every test passes, else 0.0.

Both harnesses lift Python's limit on converting long integers to text
(`sys.set_int_max_str_digits(0)`, on by default since 3.11 at 4,300 digits), so
`print(2**20000)` prints its 6,021 digits as it does outside the sandbox.

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

import decimal
import math
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
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)
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
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)
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


DEFAULT_TOLERANCE = 1e-6  # absolute or relative, as Codeforces' real-number checkers
_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_SPACES = re.compile(r"(\s+)")


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _token_matches(got: str, want: str, tolerance: float) -> bool:
    if got == want:
        return True
    if tolerance == 0 or _INTEGER.fullmatch(want):
        return False  # an expected integer is exact (and may be longer than any float)
    if not (_DECIMAL.fullmatch(got) and _DECIMAL.fullmatch(want)):
        return False
    g, w = float(got), float(want)  # float() has no digit limit; 1e999 is inf
    # + 1e-15: "0.333334" - "0.333333" is 1.0000000000287557e-06 in binary (testlib adds it too)
    bound = (tolerance + 1e-15) * max(1.0, abs(w))
    return math.isfinite(g) and math.isfinite(w) and abs(g - w) <= bound


def outputs_match(got: str, want: str, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """Whether a program's stdout `got` matches the expected `want` (the module docstring
    says how: line by line, token by token, decimals within `tolerance`)."""
    got, want = _normalise(got), _normalise(want)
    if got == want:
        return True
    g_lines, w_lines = got.split("\n"), want.split("\n")
    if len(g_lines) != len(w_lines):
        return False
    for g_line, w_line in zip(g_lines, w_lines, strict=True):
        g_tokens, w_tokens = _SPACES.split(g_line), _SPACES.split(w_line)
        if len(g_tokens) != len(w_tokens) or not all(
            _token_matches(g, w, tolerance) for g, w in zip(g_tokens, w_tokens, strict=True)
        ):
            return False
    return True


def _expected_text(want: Any) -> str:
    """An expected output as text; an int of any length (str() refuses over 4,300 digits)."""
    if isinstance(want, int) and not isinstance(want, bool):
        return str(decimal.Decimal(want))
    return str(want)


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
    item: ScoreItem,
    sandbox: BwrapSandbox | NoSandbox,
    limits: Limits,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[float, dict[str, Any]]:
    """Score one item; details hold pass counts and the first failure's stderr tail.
    `tolerance`: how far decimals in stdin/stdout outputs may differ (module docstring).

    Raises:
        ValueError: the item's metadata has neither test shape (it cannot be scored), or
            `tolerance` is negative or not finite.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(
            f"the code reward's float_tolerance must be finite and >= 0, got {tolerance}"
        )
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
            if out is not None and outputs_match(out, _expected_text(want), tolerance):
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
