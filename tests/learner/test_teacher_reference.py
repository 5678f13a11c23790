"""A reference with its own folder (on-policy distillation's teacher): the learner's
`ref_logprobs` pass scores with the teacher's weights, not the policy's, with full
fine-tuning and with LoRA (where a reference is otherwise the policy with its adapter
off). One gloo rank, tiny models."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_fsdp import make_batch
from tests.tiny_model import build_tiny_model


def _rank_main(rank, world, student, teacher, adapter, port, queue):
    settings = LearnerSettings(
        model_path=str(student),
        compute_dtype="float32",
        load_reference=True,
        reference_path=str(teacher),
        adapter=AdapterSettings(type=adapter),
    )
    w = LearnerWorker(rank, world, settings, threads=1)
    w.setup(port)
    batch = make_batch()
    got = w.compute(batch, 0, "ref_logprobs")
    policy = w.compute(batch, 0, "old_logprobs")
    buf = io.BytesIO()
    torch.save((got, policy), buf)
    queue.put(buf.getvalue())
    w.close()


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_reference_pass_scores_with_the_teacher_folder(tiny_model, tmp_path, adapter):
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    got, policy = run_ranks(_rank_main, 1, tiny_model, teacher, adapter)
    batch = make_batch()
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
        want = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_start)
    want = want * batch.response_mask
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-4)
    assert float((got - policy).abs().max()) > 0.1  # not the student's own logprobs
