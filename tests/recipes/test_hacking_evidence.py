"""Evidence of the reward-hacking monitors: the samples chosen, hacking.jsonl written once
per firing, `posttrain status` and /api/hacking showing it, and `monitor.on_hacking`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from posttrain.config import HackingConfig
from posttrain.recipes.monitoring.dashboard import create_dashboard
from posttrain.recipes.monitoring.evidence import (
    HACKING_FILE,
    HackingStopped,
    evidence_lines,
    guard,
    hacking_ranges,
    select_samples,
    watch,
)
from posttrain.recipes.monitoring.hacking import Firing
from posttrain.recipes.monitoring.status import print_status


def sample(uid: str, group: str, reward: float, text: str = "42", **details) -> dict:
    return {
        "uid": uid,
        "group_id": group,
        "prompt_text": "user\nCalculate 40 + 2.\nassistant\n",
        "response_text": text,
        "response_ids": list(range(len(text))),
        "reward": reward,
        "reward_details": details,
    }


ROLLOUTS = [
    sample("a0", "a", 1.0, "42", correct=1.0, format=1.0),
    sample("a1", "a", 1.0, "1, 2, 3, 42", correct=0.0, format=1.0),
    sample("b0", "b", 0.0, "no", correct=0.0, format=0.0),
    sample("b1", "b", 0.5, "x" * 700, correct=0.0, format=1.0),
    sample("c0", "c", 0.8, "12 or 13", correct=0.0, format=1.0, **{"correct.hedged": True}),
    {**sample("d0", "d", 1.0), "reward": None},  # could not be scored
]


def test_samples_by_reward_one_per_group_first():
    got = select_samples(ROLLOUTS, "reward", k=4)
    assert [s["uid"] for s in got] == ["a0", "c0", "b1", "a1"]
    assert got[0]["breakdown"] == {"correct": 1.0, "format": 1.0}
    assert got[0]["prompt"].endswith("Calculate 40 + 2.\nassistant\n")
    assert len(got[2]["response"]) == 600  # cut
    assert "d0" not in [s["uid"] for s in select_samples(ROLLOUTS, "reward", k=10)]


def test_samples_show_the_firing_kind():
    # format − mean(others): a1, b1, c0 score 1, a0 0; ties by reward (1.0, 0.8, 0.5)
    got = select_samples(ROLLOUTS, "component:format", 3)
    assert [s["uid"] for s in got] == ["a1", "c0", "b1"]
    assert [s["uid"] for s in select_samples(ROLLOUTS, "signature:hedged", 1)] == ["c0"]
    assert [s["uid"] for s in select_samples(ROLLOUTS, "signature:many_answers", 1)] == ["a1"]
    assert [s["uid"] for s in select_samples(ROLLOUTS, "length", 1)] == ["b1"]
    # reward − correct: a1 1.0, c0 0.8, b1 0.5, a0 0 (paid, and correct: no exploit)
    got = select_samples(ROLLOUTS, "strict:correct", 4)
    assert [s["uid"] for s in got] == ["a1", "c0", "b1", "a0"]
    assert select_samples([], "reward") == []


def write_rollouts(run_dir: Path, step: int, rows: list[dict]) -> None:
    (run_dir / "rollouts").mkdir(exist_ok=True)
    with open(run_dir / "rollouts" / f"step_{step:05d}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def hedging_history(n: int) -> list[dict]:
    return [{"step": s, "hack/hedged": 0.5, "advisories": []} for s in range(n)]


def test_watch_records_evidence_once_per_firing(tmp_path):
    history = hedging_history(4)
    for s in (4, 5):
        write_rollouts(tmp_path, s, ROLLOUTS)
    firings, started = watch(history, {"step": 4, "hack/hedged": 0.5}, HackingConfig(), tmp_path)
    assert [f.code for f in firings] == [f.code for f in started] == ["hacking_hedged"]
    row4 = {"step": 4, "hack/hedged": 0.5, "advisories": [firings[0].advisory]}
    firings, started = watch(
        [*history, row4], {"step": 5, "hack/hedged": 0.5}, HackingConfig(), tmp_path
    )
    assert [f.code for f in firings] == ["hacking_hedged"] and started == []  # goes on
    lines = [json.loads(x) for x in (tmp_path / HACKING_FILE).read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 4 and lines[0]["code"] == "hacking_hedged"
    assert lines[0]["samples"][0]["uid"] == "c0"
    assert [p["step"] for p in lines[0]["trajectory"]] == [0, 1, 2, 3, 4]


def test_watch_without_saved_rollouts_says_so(tmp_path):
    watch(hedging_history(4), {"step": 4, "hack/hedged": 0.5}, HackingConfig(), tmp_path)
    line = json.loads((tmp_path / HACKING_FILE).read_text())
    assert line["samples"] == [] and "monitor.save_rollouts" in line["note"]


def finished_run(tmp_path: Path) -> Path:
    """A run folder whose steps 4–5 raised hacking_hedged, with its evidence."""
    history = hedging_history(4)
    write_rollouts(tmp_path, 4, ROLLOUTS)
    for s in (4, 5):
        firings, _ = watch(history, {"step": s, "hack/hedged": 0.5}, HackingConfig(), tmp_path)
        history.append({"step": s, "hack/hedged": 0.5, "advisories": [f.advisory for f in firings]})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    return tmp_path


def test_status_and_dashboard_show_the_evidence(tmp_path, capsys):
    run_dir = finished_run(tmp_path)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = hacking_ranges(rows, run_dir)
    assert [(f["code"], f["steps"], f["evidence_step"]) for f in got] == [
        ("hacking_hedged", "steps 4–5", 4)
    ]
    lines = evidence_lines(got[0])
    assert lines[0].startswith("trajectory (step: hack/hedged): 0: 0.5; 1: 0.5")
    assert lines[1] == "sample c0 reward 0.8 (correct=0.0 format=1.0): '12 or 13'"
    print_status(run_dir, rows, last=10)
    out = capsys.readouterr().out
    assert "steps 4–5: hacking_hedged: 50% of the last 5 steps' samples" in out
    assert "sample c0 reward 0.8" in out
    api = TestClient(create_dashboard(run_dir)).get("/api/hacking").json()
    assert api == json.loads(json.dumps(got))
    assert api[0]["samples"][0]["breakdown"]["correct.hedged"] is True


FIRING = Firing("hacking_hedged", "50% hedged", 0, 4)


def test_guard_warn_does_nothing(tmp_path):
    assert guard("warn", [FIRING], 5, tmp_path, save=lambda: pytest.fail("saved")) is None


def test_guard_checkpoint_saves_once_and_goes_on(tmp_path):
    saved = []
    folder = tmp_path / "checkpoints" / "step_00005"
    assert guard("checkpoint", [FIRING], 5, tmp_path, lambda: saved.append(5) or folder) == folder
    assert saved == [5]
    assert guard("checkpoint", [], 6, tmp_path, save=lambda: pytest.fail("saved")) is None
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")  # the step's checkpoint was due anyway
    assert guard("checkpoint", [FIRING], 5, tmp_path, save=lambda: pytest.fail("saved")) is None


def test_guard_stop_saves_then_raises(tmp_path):
    saved = []
    with pytest.raises(HackingStopped, match=r"step 4: hacking_hedged fired .* --resume"):
        guard("stop", [FIRING], 5, tmp_path, lambda: saved.append(5) or tmp_path)
    assert saved == [5]
    assert guard("stop", [], 5, tmp_path, save=lambda: pytest.fail("saved")) is None
    with pytest.raises(ValueError, match="warn, checkpoint or stop"):
        guard("halt", [FIRING], 5, tmp_path, save=lambda: tmp_path)
