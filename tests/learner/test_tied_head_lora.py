"""A LoRA on `lm_head` of a model whose head is tied to its embedding is refused at
`validate` and at the learner's start, naming the key and the fix (issue 47: it was
accepted, then every merged push and `save_merged` crashed in `merged_state_dict` with
`KeyError: attribute 'weight' already exists`; a tied model's engines cannot hold a head
that differs from the embedding). An untied head (the fix the message names) takes the
LoRA, with one policy in every mode: the learner's own forward, save_merged, a merged
push and an adapter push to hf and vLLM engines (fp32)."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.actors.engine import EngineSettings
from posttrain.actors.hf_engine import HFEngine
from posttrain.actors.rollout import PromptRequest, SamplingSettings
from posttrain.actors.worker import RolloutWorker
from posttrain.common.net import free_port
from posttrain.config import RecipeError
from posttrain.learner import adapters
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.learner.push import push_source
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.preflight import check_runtime_inputs
from posttrain.weightsync import Delivery, TransportSettings, check_delivery
from tests.conftest import ROOT
from tests.engine_host import requires_vllm
from tests.learner.test_fsdp import make_batch
from tests.tiny_model import build_tiny_model

FIX = "remove 'lm_head' from model.adapter.target_modules.*tie_word_embeddings: false"


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("untied") / "model", tied=False)


def _recipe(model, targets):
    return load_recipe(
        ROOT / "recipes" / "quickstart_grpo.yaml",
        [
            f"model.path={model}",
            "rollout.engine=hf",
            f"model.adapter={{type: lora, target_modules: {targets}}}",
        ],
    )


def test_validate_refuses_lora_on_a_tied_head(tiny_model, untied_model):
    with pytest.raises(RecipeError, match=f"model.adapter.target_modules: 'lm_head'.*{FIX}"):
        check_runtime_inputs(_recipe(tiny_model, "[q_proj, lm_head]"))
    check_runtime_inputs(_recipe(tiny_model, "[q_proj]"))
    check_runtime_inputs(_recipe(untied_model, "[q_proj, lm_head]"))


def test_learner_refuses_lora_on_a_tied_head(tiny_model, untied_model):
    with pytest.raises(ValueError, match=f"model.adapter.target_modules: 'lm_head'.*{FIX}"):
        adapters.check_targets(str(tiny_model), ("q_proj", "lm_head"))
    adapters.check_targets(str(untied_model), ("q_proj", "lm_head"))


# -- an untied head takes the LoRA, the same policy in every mode ---------------------------
TARGETS = ("q_proj", "lm_head")
KINDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, requires_vllm])]


@pytest.fixture(scope="module")
def untied_vllm_model(tmp_path_factory):
    """Untied, at head_dim 32 (vLLM's CPU kernels)."""
    folder = tmp_path_factory.mktemp("untied_vllm") / "model"
    return build_tiny_model(folder, hidden=128, max_positions=1024, tied=False)


def _learner(model, save_merged=False):

    adapter = AdapterSettings(
        type="lora", r=4, alpha=8.0, target_modules=TARGETS, save_merged=save_merged
    )
    s = LearnerSettings(
        model_path=str(model),
        compute_dtype="float32",
        adapter=adapter,
        transport=TransportSettings("object_store", checksum=True, adapter_only=True),
    )
    w = LearnerWorker(0, 1, s, threads=1)
    w.setup(free_port())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter; the head's moves the logits
        for n, p in w.policy.named_parameters():
            if "lora_" in n:
                p.to_local().copy_(0.3 * torch.randn(p.shape, generator=g))
    return w


def _logprobs(model, batch):

    with torch.no_grad():
        return (
            sequence_logprobs(
                model.eval(), batch.input_ids, batch.attention_mask, batch.response_start
            )
            * batch.response_mask
        )


def test_lora_on_an_untied_head_learner_save_merged_and_merged_push_agree(
    untied_vllm_model, tmp_path
):

    w = _learner(untied_vllm_model, save_merged=True)
    try:
        batch = make_batch()
        own = w.compute(batch, 0, "old_logprobs")  # the learner's own forward
        merged = w._full_state_dict()
        assert not torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])
        ref = AutoModelForCausalLM.from_pretrained(untied_vllm_model, dtype=torch.float32)
        base = _logprobs(ref, batch)
        ref.load_state_dict(merged)
        want = _logprobs(ref, batch)
        assert (want - base).abs().max() > 1e-2  # the adapter (head included) matters
        torch.testing.assert_close(own, want, rtol=0, atol=1e-5)
        w.save_checkpoint(str(tmp_path / "final"), step=1)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged")
        torch.testing.assert_close(_logprobs(saved.float(), batch), want, rtol=0, atol=1e-5)
        engine = HFEngine(str(untied_vllm_model), "float32")
        src = push_source(w.policy, 0, w.s.model_path, w.s.adapter, torch.float32, "merged")
        engine.load_weights(src.tensors)
        torch.testing.assert_close(_logprobs(engine.model, batch), want, rtol=0, atol=1e-5)
    finally:
        w.close()


@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_an_untied_head_adapter_push(ray_local, untied_vllm_model, kind):

    w = _learner(untied_vllm_model)
    model = str(untied_vllm_model)
    settings = EngineSettings(kind, model, "float32", lora_rank=4)
    engine = ray.remote(num_cpus=0)(RolloutWorker).remote(0, settings, "object_store", 1)
    try:
        gen = w.publish_weights(1)
        assert ray.get(engine.update_weights.remote(next(gen), 0)) == 1
        check_delivery(
            [d for d in gen if isinstance(d, Delivery)][-1], ray.get(engine.delivery.remote()), 0
        )
        ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        ref.load_state_dict(w._full_state_dict())
        req = PromptRequest("g", [{"role": "user", "content": "12+30="}])
        s = SamplingSettings(n=3, max_new_tokens=12, temperature=1.0, seed=4)
        for r in ray.get(engine.generate.remote([req], s, 1)):
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            with torch.no_grad():
                lp = sequence_logprobs(ref, ids, torch.ones_like(ids), len(r.prompt_ids))
            torch.testing.assert_close(
                torch.tensor(r.inference_logprobs), lp[0, len(r.prompt_ids) :], rtol=0, atol=1e-4
            )
    finally:
        ray.kill(engine)
        w.close()
