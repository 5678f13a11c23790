"""The code reward passes a test only on evidence that it ran to its end: every way of
ending early with status 0 scores 0, and honest programs still pass."""

from __future__ import annotations

import warnings

import pytest

from posttrain.rewards.code_verifier import score_code
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.sandbox import BwrapSandbox, Limits, NoSandbox

LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=256, max_procs=16)
SQUARE = {
    "code_prefix": "def square(x):\n",
    "entry_point": "square",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n",
}
SQUARE_ABS = {**SQUARE, "test": "def check(candidate):\n    assert abs(candidate(3) - 9) < 1e-9\n"}

# Completions of `def square(x):` that are wrong (return 0) and try to score anyway.
EARLY_EXITS = {
    "os_exit": "    return 0\nimport os\nos._exit(0)\n",
    "sys_exit": "    return 0\nimport sys\nsys.exit(0)\n",
    "raise_systemexit": "    return 0\nraise SystemExit\n",
    "exit_builtin": "    return 0\nexit()\n",
    "quit_builtin": "    return 0\nquit(0)\n",
    "exec_exit": "    return 0\nexec('import os; os._exit(0)')\n",
    "kill_self": "    return 0\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "atexit_exit_0": "    return 0\nimport atexit, os\natexit.register(os._exit, 0)\n"
    "raise SystemExit(1)\n",
    "exit_inside_candidate": "    import os\n    os._exit(0)\n",
    "systemexit_inside_candidate": "    raise SystemExit(0)\n",
    "thread_exits_0": "    import time\n    time.sleep(5)\nimport os, threading\n"
    "threading.Thread(target=os._exit, args=(0,)).start()\n",
    "close_stdout_then_exit": "    return 0\nimport os, sys\nsys.stdout.close()\nos.close(1)\n"
    "os._exit(0)\n",
    "trace_hook_exits_in_check": "    return 0\nimport sys\n"
    "def _t(frame, event, arg):\n"
    "    if frame.f_code.co_name == 'check':\n"
    "        raise SystemExit(0)\n"
    "sys.settrace(_t)\n",
    "profile_hook_exits_in_check": "    return 0\nimport sys, os\n"
    "def _p(frame, event, arg):\n"
    "    if frame.f_code.co_name == 'check':\n"
    "        os._exit(0)\n"
    "sys.setprofile(_p)\n",
    "print_own_cmdline": "    return 0\nimport os\n"
    "os.write(1, open('/proc/self/cmdline', 'rb').read())\nos._exit(0)\n",
    "print_stdin": "    return 0\nimport os, sys\nprint(sys.stdin.read(), flush=True)\n"
    "os._exit(0)\n",
}


@pytest.fixture(scope="module")
def sandbox():
    return BwrapSandbox()


def _humaneval(completion, meta=SQUARE):
    return ScoreItem(uid="s", response=completion, metadata=meta)


@pytest.mark.parametrize("trick", sorted(EARLY_EXITS))
def test_humaneval_early_exit_scores_zero(trick, sandbox):
    score, details = score_code(_humaneval(EARLY_EXITS[trick]), sandbox, LIMITS)
    assert score == 0.0, details
    assert details["passed"] == 0


def test_patched_builtins_do_not_change_what_the_tests_compute(sandbox):
    cheat = "    return 0\nimport builtins\nbuiltins.abs = lambda v: 0\n"
    assert score_code(_humaneval(cheat, SQUARE_ABS), sandbox, LIMITS)[0] == 0.0
    assert score_code(_humaneval("    return x * x\n", SQUARE_ABS), sandbox, LIMITS)[0] == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "    return x * x\n",
        "    return x * x\nimport builtins\nbuiltins.print = lambda *a, **k: None\n",
        "    return x * x\nprint('x' * 200_000)\n",  # more than the 64 KiB of output kept
        "    return x * x\nimport os\nos.close(1)\n",
        "    return x * x\nimport atexit\natexit.register(print, 'bye')\n",
    ],
)
def test_honest_humaneval_solutions_still_pass(completion, sandbox):
    assert score_code(_humaneval(completion), sandbox, LIMITS)[0] == 1.0


def _stdio(program, outputs, inputs=None):
    return ScoreItem(
        uid="s",
        response=program,
        metadata={"inputs": inputs or [""] * len(outputs), "outputs": outputs},
    )


@pytest.mark.parametrize(
    ("program", "want"),
    [
        ("import os\nos._exit(0)", ""),  # expected output empty: nothing printed is not enough
        ("import atexit, os\natexit.register(os._exit, 0)\nraise SystemExit(1)", ""),
        (
            "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
            "time.sleep(5)",
            "",
        ),
        ("print('ok', flush=True)\nimport os\nos._exit(0)", "ok"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ""),
        ("print('ok')\nraise SystemExit(2)", "ok"),
    ],
)
def test_stdio_early_exit_scores_zero(program, want, sandbox):
    score, details = score_code(_stdio(program, [want]), sandbox, LIMITS)
    assert score == 0.0, details


@pytest.mark.parametrize(
    "program",
    [
        "print('ok')",
        "print('ok')\nimport sys\nsys.exit()",
        "print('ok')\nexit(0)",
        "import sys\nsys.stdout.write('ok')",
        "import atexit\natexit.register(print, 'ok')",  # printed after the marker: still counted
        "import sys\nout = []\nout.append('ok')\nsys.stdout.write(''.join(out))\nraise SystemExit",
    ],
)
def test_honest_stdio_programs_still_pass(program, sandbox):
    assert score_code(_stdio(program, ["ok"]), sandbox, LIMITS) == (
        1.0,
        {"passed": 1, "total": 1, "stderr": ""},
    )


def test_empty_expected_output_passes_a_program_that_runs_to_its_end(sandbox):
    assert score_code(_stdio("x = 1", [""]), sandbox, LIMITS)[0] == 1.0


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_secret_waits_in_a_pipe_not_in_the_program(kind, sandbox):
    if kind == "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box = NoSandbox()
    else:
        box = sandbox
    probe = (
        "import os, sys\n"
        "needle = b's3' + b'cr3t'\n"  # not the secret's text itself
        "print(needle in open('/proc/self/cmdline', 'rb').read())\n"
        "print(needle in open('/proc/self/environ', 'rb').read())\n"
        "print(os.read(int(sys.argv[-1]), 64))"
    )
    res = box.run(probe, None, LIMITS, secret=b"s3cr3t")
    assert res.stdout.split() == ["False", "False", "b's3cr3t'"], res.stderr
