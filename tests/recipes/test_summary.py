"""The console summary of an RL run: the step time it prints is the median (a first
step's warm-up does not move it), and it says so."""

from __future__ import annotations

from pathlib import Path

from posttrain.recipes.monitoring.summary import print_summary


def _step(step: float, train: float) -> dict[str, float]:
    return {
        "reward_mean": 0.5,
        "time/step": step,
        "time/generate": 1.0,
        "time/score": 0.0,
        "time/logprobs": 0.0,
        "time/train": train,
        "time/weight_sync": 0.25,
        "rollout_idle_fraction": 0.5,
        "learner_idle_fraction": 0.25,
    }


def test_the_step_time_is_the_median_and_labelled_so(capsys):
    # a 12.6 s first step: mean 7.6 s, median 5.2 s
    history = [_step(12.6, 8.0), _step(5.0, 3.0), _step(5.2, 3.4)]
    print_summary(history, Path("runs/x"), 30.0)
    line = next(x for x in capsys.readouterr().out.splitlines() if "step" in x and "median" in x)
    assert line.strip() == (
        "median step 5.2s; medians of its parts: generate 1.0s  score 0.0s  logprobs 0.0s  "
        "train 3.4s  weight_sync 0.2s"
    )
