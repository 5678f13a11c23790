"""A resume under adapter-only sync (issue 47): the engines start from the checkpoint's
base and receive QLoRA's dequantised base once more, now under a trained adapter; the
base must come without the adapter, else the engine applies it twice and samples
another policy than the learner's (CPU, fp32, `engine: hf`: every step's
`logprob_mismatch`, engine against learner, stays under 1e-4)."""

from __future__ import annotations

from posttrain.recipes import checkpoints
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run
from tests.test_grpo_e2e import _grpo_recipe


def _recipe(tmp_path, model, steps):
    folder = tmp_path / f"r{steps}"
    folder.mkdir(exist_ok=True)
    return load_recipe(
        _grpo_recipe(
            folder,
            model,
            model={
                "path": str(model),
                "dtype": "float32",
                "adapter": {"type": "qlora", "r": 8, "alpha": 16},
            },
            rollout={"engine": "hf", "samples_per_prompt": 4, "max_new_tokens": 6},
            rewards=[{"name": "digit", "type": "format", "pattern": "[0-9]"}],
            train={"steps": steps, "prompts_per_step": 2, "micro_batch_size": 4, "lr": 5e-2},
            weight_sync={"type": "object_store", "adapter_mode": "adapter"},
        )
    )


def test_qlora_adapter_sync_resume_samples_the_learners_policy(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    first = run(_recipe(tmp_path, tiny_model, 1), run_dir)
    assert first[0]["grad_norm"] > 0  # the adapter moved: B is no longer 0
    ckpt = checkpoints.latest(run_dir)
    rest = run(_recipe(tmp_path, tiny_model, 2), run_dir, resume=ckpt)
    assert [h["policy_version"] for h in first + rest] == [1, 2]
    for h in first + rest:
        assert h["logprob_mismatch"] < 1e-4, h
