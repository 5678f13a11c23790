"""`algorithm: distill` in the schema and before start: the teacher is required, its
keys act only with distill, and a teacher whose tokenizer differs is refused with exit 2
naming `distill.teacher` and both tokenizers (tiny models, no Ray)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from posttrain.common.model_folder import load_tokenizer
from posttrain.config import RecipeError
from posttrain.recipes.algo.teacher import check_teacher_tokenizer, vocab_difference
from posttrain.recipes.cli import app
from posttrain.recipes.loading import load_recipe
from tests.conftest import ROOT
from tests.test_grpo_e2e import _grpo_recipe
from tests.tiny_model import build_tiny_model

QUICKSTART = ROOT / "recipes" / "quickstart_grpo.yaml"


def _distill_file(tmp_path, student, teacher, **distill):
    recipe_file = _grpo_recipe(tmp_path, student)
    body = yaml.safe_load(recipe_file.read_text())
    body["algorithm"] = "distill"
    body["distill"] = {"teacher": str(teacher), **distill}
    recipe_file.write_text(yaml.safe_dump(body))
    return recipe_file


def test_distill_needs_a_teacher():
    with pytest.raises(RecipeError, match="distill.teacher: algorithm distill needs"):
        load_recipe(QUICKSTART, ["algorithm=distill"])


def test_distill_keys_are_refused_with_another_algorithm():
    with pytest.raises(RecipeError, match="distill.teacher is set, but algorithm is grpo"):
        load_recipe(QUICKSTART, ["distill.teacher=runs/x/final"])


def test_reward_mix_needs_groups():
    with pytest.raises(RecipeError, match="rollout.samples_per_prompt: 2 or more"):
        load_recipe(
            QUICKSTART,
            [
                "algorithm=distill",
                "distill.teacher=t",
                "distill.reward_weight=0.5",
                "rollout.samples_per_prompt=1",
            ],
        )


def test_facts_name_the_teacher_as_the_reference():
    r = load_recipe(QUICKSTART, ["algorithm=distill", "distill.teacher=some/folder"])
    assert r.facts.teacher == "some/folder" and r.facts.reference
    assert r.facts.passes.reference_forward == 1 and r.facts.updates_per_step == 1
    assert load_recipe(QUICKSTART, []).facts.teacher is None


def test_same_tokenizer_passes(tiny_model, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # other weights, same tokenizer
    r = load_recipe(_distill_file(tmp_path, tiny_model, teacher))
    assert check_teacher_tokenizer(r) is True


def test_teacher_with_another_tokenizer_exits_2_naming_key_and_both(tiny_model, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", extra_specials=("<tool>",))
    recipe_file = _distill_file(tmp_path, tiny_model, teacher)
    with pytest.raises(RecipeError) as e:
        check_teacher_tokenizer(load_recipe(recipe_file))
    msg = str(e.value)
    assert msg.startswith("distill.teacher: the teacher's tokenizer")
    kind = type(load_tokenizer(tiny_model)).__name__  # transformers' fast-tokenizer class
    assert f"{teacher} ({kind}, 101 tokens)" in msg
    assert f"(model.path) {tiny_model} ({kind}, 100 tokens)" in msg
    assert "the teacher has 1 tokens the student lacks, first '<tool>' (id 100)" in msg
    for command in ("validate", "run"):
        out = CliRunner().invoke(app, [command, str(recipe_file)])
        assert out.exit_code == 2, out.output
        assert "distill.teacher: the teacher's tokenizer" in out.output


def test_missing_teacher_folder_exits_2(tiny_model, tmp_path):
    recipe_file = _distill_file(tmp_path, tiny_model, tmp_path / "nowhere")
    out = CliRunner().invoke(app, ["validate", str(recipe_file)])
    assert out.exit_code == 2
    assert "distill.teacher:" in out.output and "nowhere" in out.output


def test_vocab_difference_names_the_first_token_by_id():
    assert vocab_difference({"a": 0, "b": 1}, {"a": 0, "b": 1}) is None
    assert vocab_difference({"a": 0, "b": 1}, {"a": 0, "b": 2}) == (
        "token 'b' is id 1 in the student and is id 2 in the teacher"
    )
    assert vocab_difference({"a": 0, "b": 1}, {"a": 0}) == (
        "token 'b' is id 1 in the student and is missing in the teacher"
    )


def test_step_trains_on_teacher_minus_engine_logprobs(monkeypatch):
    """The algorithm object's step on a stand-in learner: the teacher pass is the
    reference pass, and the update's advantages are teacher − inference logprobs on the
    response tokens, plus reward_weight × the group advantage (hand values)."""
    import torch

    import posttrain.recipes.algo.base as base_mod
    import posttrain.recipes.algo.distill as distill_mod
    from posttrain.actors.rollout import Rollout
    from posttrain.recipes.algo import algorithm_for
    from posttrain.recipes.algo.rollouts import rollout_batch

    # two samples of one prompt: prompt [1, 2], responses of 2 and 1 tokens
    rollouts = [
        Rollout("a", "g", [1, 2], [3, 4], [-0.5, -1.0], "stop", 0, "p", "r"),
        Rollout("b", "g", [1, 2], [5], [-2.0], "stop", 0, "p", "r"),
    ]
    teacher = torch.tensor([[0.0, 0.0, -0.25, -3.0], [0.0, 0.0, -1.0, 0.0]])
    sent = {}

    def on_learners(learners, method, batch, step, *args):
        if method == "compute":
            assert args == ("ref_logprobs",)
            return [teacher[: len(batch)] * batch.response_mask]
        sent["advantages"] = batch.advantages.clone()
        return [{"loss": 0.0, "grad_norm": 1.0, "lr": 0.1}]

    for mod in (base_mod, distill_mod):
        monkeypatch.setattr(mod, "on_learners", on_learners)
    recipe = load_recipe(
        QUICKSTART, ["algorithm=distill", "distill.teacher=t", "distill.reward_weight=0.5"]
    )
    rewards = [1.0, 0.0]  # group advantages (std-scaled): +0.7071, −0.7071
    batch = rollout_batch(rollouts, rewards, pad_id=0)
    stats = algorithm_for(recipe).train([None], batch, rollouts, rewards, step=0)
    # row a: −0.25 − (−0.5) = 0.25, −3 − (−1) = −2; row b: −1 − (−2) = 1 (then padding)
    a = 0.5 * 0.70710677
    want = torch.tensor([[0.0, 0.0, 0.25 + a, -2.0 + a], [0.0, 0.0, 1.0 - a, 0.0]])
    torch.testing.assert_close(sent["advantages"], want, rtol=0.0, atol=1e-6)
    # reverse KL: mean of (student − teacher) over 3 tokens = (−0.25 + 2 − 1) / 3
    assert abs(stats["distill/reverse_kl"] - 0.25) < 1e-6


def test_student_with_more_vocabulary_rows_than_the_teacher_exits_2(tiny_model, tmp_path):
    # issue 47: 152064 rows against 151936 validated, then an IndexError at the first
    # sampled id past the teacher's rows; same tokenizer, rows padded (as Qwen2.5's)
    student = build_tiny_model(tmp_path / "student", vocab_size=128)
    teacher = build_tiny_model(tmp_path / "teacher", vocab_size=112)
    recipe_file = _distill_file(tmp_path, student, teacher)
    with pytest.raises(RecipeError) as e:
        check_teacher_tokenizer(load_recipe(recipe_file))
    assert str(e.value).startswith(
        f"distill.teacher: the student (model.path) {student} has vocab_size 128 and the "
        f"teacher {teacher} has 112;"
    )
    out = CliRunner().invoke(app, ["validate", str(recipe_file)])
    assert out.exit_code == 2 and "vocab_size 128" in out.output, out.output
    # a teacher with more rows scores every id the student samples
    assert check_teacher_tokenizer(load_recipe(_distill_file(tmp_path, teacher, student)))
