"""The reward-hacking monitors inside a real run (tiny random model, 3 GRPO steps): a
firing reaches metrics.jsonl with its evidence in hacking.jsonl, and
`monitor.on_hacking: stop` saves a checkpoint and stops the run after that step."""

from __future__ import annotations

import json

import pytest

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from posttrain.recipes.monitoring.evidence import HackingStopped
from tests.test_grpo_e2e import _grpo_recipe


def test_on_hacking_stop_checkpoints_and_stops(tiny_model, tmp_path):
    # window 1 and an entropy bound a hair above 1: any change of entropy between step 0
    # and step 1 fires hacking_entropy at step 1
    recipe_file = _grpo_recipe(
        tmp_path,
        tiny_model,
        train={"steps": 3, "prompts_per_step": 2, "micro_batch_size": 4, "lr": 1e-3},
        monitor={
            "progress": False,
            "dashboard_port": None,
            "tensorboard": False,
            "on_hacking": "stop",
            "hacking": {"window": 1, "entropy_ratio": 1.000001},
        },
    )
    run_dir = tmp_path / "run"
    with pytest.raises(HackingStopped, match=r"step 1: hacking_entropy fired"):
        run(load_recipe(recipe_file), run_dir)

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # stopped after step 1
    assert not any(a.startswith("hacking_") for a in rows[0]["advisories"])
    assert any(a.startswith("hacking_entropy: ") for a in rows[1]["advisories"])
    assert {"hack/early_exit", "hack/hedged", "repetition", "entropy"} <= rows[1].keys()
    (line,) = [json.loads(x) for x in (run_dir / "hacking.jsonl").read_text().splitlines()]
    assert line["code"] == "hacking_entropy" and line["step"] == 1
    assert [p["step"] for p in line["trajectory"]] == [0, 1]
    assert (
        len(line["samples"]) == 4
        and {"prompt", "response", "breakdown"} <= line["samples"][0].keys()
    )
    assert (run_dir / "checkpoints" / "step_00002" / "trainer_state.json").is_file()
