"""SFT end to end on a tiny model with 2 learner ranks: the loss falls, the held-out loss
is measured, the saved policy loads, no rollout side starts; packing changes nothing of
step 0's loss; LoRA and QLoRA train; a resume continues the conversation order."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from posttrain.recipes import checkpoints
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.loop import run


def _chat(i: int) -> dict:
    turns = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": f"{i}+{i}?"},
        {"role": "assistant", "content": "<tool_call>add</tool_call>"},
        {"role": "tool", "content": str(2 * i)},
        {"role": "assistant", "content": f"{2 * i}"},
    ]
    return {"messages": turns[: 3 if i % 3 == 0 else 5]}


@pytest.fixture
def sft_recipe(tiny_model, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(12)))

    def make(name: str, steps: int = 4, **sft):
        f = tmp_path / f"{name}.yaml"
        f.write_text(
            yaml.safe_dump(
                {
                    "name": name,
                    "algorithm": "sft",
                    "model": {"path": str(tiny_model), "dtype": "float32"},
                    "data": {"train": {"path": str(data)}},
                    "sft": {"max_length": 128, "eval_examples": 2, "eval_every": 2, **sft},
                    "train": {
                        "steps": steps,
                        "prompts_per_step": 4,
                        "micro_batch_size": 2,
                        "lr": 1e-2,
                    },
                    "resources": {"learner": {"gpus": 2}, "threads_per_worker": 1},
                    "monitor": {"progress": False, "dashboard_port": None, "tensorboard": False},
                }
            )
        )
        return f

    return make, data


def test_sft_trains_evaluates_and_saves(sft_recipe, tmp_path):
    make, _ = sft_recipe
    packed = run(load_recipe(make("packed")), tmp_path / "a")
    plain = run(load_recipe(make("plain", steps=1, packing=False)), tmp_path / "b")
    # same conversations, same weights: packing changes the layout, not the loss
    assert packed[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-5)
    assert packed[-1]["loss"] < packed[0]["loss"]
    assert [("eval/loss" in m) for m in packed] == [False, True, False, True]
    assert packed[3]["eval/loss"] < packed[1]["eval/loss"] + 1.0
    assert not (tmp_path / "a" / "rollouts").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and "sft/assistant_tokens" in json.loads(lines[0])


# slow: LoRA is QLoRA's adapter path without the quantised base
@pytest.mark.parametrize("kind", [pytest.param("lora", marks=pytest.mark.slow), "qlora"])
def test_sft_adapters_train(sft_recipe, tmp_path, kind):
    make, _ = sft_recipe
    r = load_recipe(
        make(kind, steps=2),
        [f"model.adapter.type={kind}", "model.adapter.r=4", "model.adapter.alpha=8"]
        + ["resources.learner.gpus=1", "train.lr=5e-2"],
    )
    hist = run(r, tmp_path / kind)
    assert hist[1]["loss"] < hist[0]["loss"]
    assert (tmp_path / kind / "final" / "adapter_config.json").is_file()


@pytest.mark.slow  # 3 runs, about a minute
def test_sft_resume_continues_the_order(sft_recipe, tmp_path):
    make, _ = sft_recipe
    want = run(load_recipe(make("s2", steps=2)), tmp_path / "straight")
    run(load_recipe(make("s1", steps=1)), tmp_path / "split")
    ckpt = checkpoints.latest(tmp_path / "split")
    rest = run(load_recipe(make("s2b", steps=2)), tmp_path / "split", resume=ckpt)
    assert [m["loss"] for m in rest] == [want[1]["loss"]]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "split" / "final" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
