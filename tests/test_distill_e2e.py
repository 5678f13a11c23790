"""On-policy distillation end to end on tiny random models: the student samples on a
Ray rollout worker (hf engine), 2 FSDP2 learner ranks hold the student and the teacher
(loaded from `distill.teacher`, another tiny model with the same tokenizer), and the
student moves toward the teacher on its own samples."""

from __future__ import annotations

import json

import yaml

from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.test_grpo_e2e import _grpo_recipe
from tests.tiny_model import build_tiny_model


def test_student_moves_toward_the_teacher(tiny_model, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    recipe_file = _grpo_recipe(tmp_path, tiny_model)
    body = yaml.safe_load(recipe_file.read_text())
    body |= {"algorithm": "distill", "distill": {"teacher": str(teacher)}}
    body["train"] |= {"steps": 4, "lr": 3e-3}
    body["data"]["train"]["size"] = 40
    recipe_file.write_text(yaml.safe_dump(body))

    run_dir = tmp_path / "run"
    history = run(load_recipe(recipe_file), run_dir)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in lines] == [1, 2, 3, 4]
    assert len(history) == 4
    kl = [m["distill/reverse_kl"] for m in lines]
    # two random models disagree: the sampled reverse KL is well above 0 at first
    assert kl[0] > 0.1
    # student − teacher per token = reverse KL; advantage = −reverse KL (kl_weight 1)
    for m in lines:
        gap = m["distill/student_logprob"] - m["distill/teacher_logprob"]
        assert abs(gap - m["distill/reverse_kl"]) < 1e-5
        assert abs(m["advantage_mean"] + m["distill/reverse_kl"]) < 1e-5
        assert m["grad_norm"] > 0.0 and m["failed_scores"] == 0
    assert kl[-1] < kl[0]  # the student learned from the teacher's judgement
    assert (run_dir / "final" / "config.json").is_file()
