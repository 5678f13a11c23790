"""LoRA and QLoRA on the FSDP2 learner (learner/adapters.py): steps with 2 ranks that
move only the adapter, the NF4 silent-gradient trap, gradients against a dequantised
base, the disabled-adapter reference (GRPO and DPO), merged pushes computed by hand,
PEFT-format checkpoints and early config errors. Tiny random model, about a minute."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from posttrain.algorithms.common import loss_denominator
from posttrain.algorithms.dpo import DPOLoss
from posttrain.common.net import free_port
from posttrain.learner import adapters
from posttrain.learner.adapters import AdapterSettings, nf4_block_sizes
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.learner.push import push_source
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from tests.learner.ranks import run_ranks
from tests.learner.test_fsdp import make_batch

R, ALPHA = 4, 8.0
LORA_KEYS = ("lora_A", "lora_B")


def _settings(model_path: Path, kind: str, dtype: str, lr: float, **kw) -> LearnerSettings:
    return LearnerSettings(
        model_path=str(model_path),
        compute_dtype=dtype,
        lr=lr,
        micro_batch_size=2,
        max_grad_norm=1e9,
        adapter=AdapterSettings(type=kind, r=R, alpha=ALPHA),
        **kw,
    )


def _plain(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


# -- two FSDP2 ranks ----------------------------------------------------------------------
def _rank_main(rank, world, model_path, kind, out_dir, port, queue):
    w = LearnerWorker(rank, world, _settings(model_path, kind, "bfloat16", 1e-2), threads=1)
    report = w.setup(port)
    batch = make_batch()
    shard = batch.shard(rank, world)
    before = adapters.gather_params(w.policy, adapter_only=False, keep=rank == 0)
    # a reference pass first (as DPO's precompute does): peft's disable_adapter() clears
    # requires_grad, which must not change how FSDP2 reduces the later gradients
    shard.ref_logprobs = w.compute(shard, 0, "ref_logprobs")
    shard.old_logprobs = w.compute(shard, 0, "old_logprobs")
    shard.loss_denominator = loss_denominator(batch.response_mask, "token_mean")
    stats = w.train_step(shard, step=0)
    after = adapters.gather_params(w.policy, adapter_only=False, keep=rank == 0)
    merged = w._full_state_dict()
    intact = adapters.gather_params(w.policy, adapter_only=False, keep=rank == 0)
    src = push_source(w.policy, rank, w.s.model_path, w.s.adapter, torch.float32, "adapter")
    tensors = dict(src.tensors)
    state = (tensors, src.meta["adapter_config"]) if rank == 0 else None
    w.save_checkpoint(str(out_dir), step=1)
    if rank == 0:
        buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with this process
        torch.save((report, stats, before, after, merged, intact, state), buf)
        queue.put(buf.getvalue())
    w.close()


def _run_two_ranks(model_path: Path, kind: str, out_dir: Path):
    return run_ranks(_rank_main, 2, model_path, kind, out_dir)


def _hand_base(model_path: Path, kind: str) -> dict[str, torch.Tensor]:
    """The frozen base as the learner stores it, built independently: bf16-rounded
    (LoRA, bf16 recipe) or NF4 round-tripped with the blocks 2 ranks need (QLoRA)."""
    from torchao.quantization import to_nf4

    out = {}
    for k, v in _plain(model_path).state_dict().items():
        if kind == "qlora" and k.endswith("proj.weight"):
            out[k] = to_nf4(v, *nf4_block_sizes(tuple(v.shape), 2)).get_original_weight()
        else:
            out[k] = v.bfloat16().float()
    return out


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_two_rank_step_moves_only_the_adapter_and_merges_by_hand(tiny_model, tmp_path, kind):
    report, stats, before, after, merged, intact, state = _run_two_ranks(
        tiny_model, kind, tmp_path / "ckpt"
    )
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    # only the adapter moved: B leaves 0 in the first step (A's gradient is B-times, so 0)
    lora_b = [k for k in after if "lora_B" in k]
    assert lora_b and all(before[k].abs().max() == 0 for k in lora_b)
    assert all(after[k].abs().max() > 1e-3 for k in lora_b)
    for k in after:
        if not any(s in k for s in LORA_KEYS):
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    # merged = base + (alpha / r) B A, by hand, under the plain transformers names
    base = _hand_base(tiny_model, kind)
    assert set(merged) == set(base)  # same keys as a full model's push, lm_head tied
    for key, w in base.items():
        stem = "base_model.model." + key.removesuffix(".weight")
        want = w
        if stem + ".lora_A.default.weight" in after:
            a, b = after[stem + ".lora_A.default.weight"], after[stem + ".lora_B.default.weight"]
            want = w + (ALPHA / R) * b @ a
        torch.testing.assert_close(merged[key], want, rtol=0, atol=1e-6, msg=key)
    for k in after:  # the learner's own adapter is intact after the merge
        torch.testing.assert_close(intact[k], after[k], rtol=0, atol=0)
    # adapter-only state: PEFT names, the trained values, the LoraConfig
    tensors, config = state
    assert config["r"] == R and config["lora_alpha"] == ALPHA
    assert len(tensors) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    torch.testing.assert_close(
        tensors[name], after[name.replace("lora_B.", "lora_B.default.")], rtol=0, atol=0
    )
    # memory report: only adapters train; NF4 holds the frozen projections in ~1/4
    assert report["trainable_params"] == sum(
        after[k].numel() for k in after if any(s in k for s in LORA_KEYS)
    )
    assert report["optimizer_bytes"] == 8 * report["trainable_params"]
    ratio = report["frozen_bytes"] / report["frozen_bytes_bf16"]
    assert ratio == pytest.approx(1.0) if kind == "lora" else ratio < 0.75
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()


# -- one rank, in this process --------------------------------------------------------------
def _one_rank(model_path: Path, kind: str, dtype: str, **kw) -> LearnerWorker:
    w = LearnerWorker(0, 1, _settings(model_path, kind, dtype, 1e-2, **kw), threads=2)
    w.setup(free_port())
    return w


def _randomise_adapter(w: LearnerWorker) -> None:
    """Non-zero A and B (B starts at 0), so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in w.policy.named_parameters():
            if "lora_" in n:
                local = p.to_local()
                local.copy_(0.3 * torch.randn(local.shape, generator=g))


def _adapter_grads(w: LearnerWorker, batch) -> dict[str, torch.Tensor]:
    w.policy.train()
    lp = w._logprobs(w.policy, batch)
    ((lp * batch.advantages).sum()).backward()
    grads = {
        n: p.grad.to_local().clone() for n, p in w.policy.named_parameters() if p.grad is not None
    }
    w.optimizers[0].zero_grad(set_to_none=True)
    return grads


def test_qlora_gradients_survive_a_logprob_pass(tiny_model):
    # bitsandbytes' CPU NF4 repacks its weights after an eval forward under no_grad and
    # later LoRA gradients change silently; torchao's NF4 must not.
    w = _one_rank(tiny_model, "qlora", "bfloat16")
    try:
        _randomise_adapter(w)
        batch = make_batch()
        first = _adapter_grads(w, batch)
        w.compute(batch, 0, "old_logprobs")  # eval mode, no_grad
        w.compute(batch, 0, "ref_logprobs")  # adapter disabled
        second = _adapter_grads(w, batch)
        assert set(first) == set(second) and len(first) == 28
        for k in first:
            torch.testing.assert_close(second[k], first[k], rtol=0, atol=1e-6, msg=k)
    finally:
        w.close()


def test_qlora_gradients_equal_a_dequantised_base_reference(tiny_model):
    from peft import get_peft_model

    w = _one_rank(tiny_model, "qlora", "float32")
    try:
        _randomise_adapter(w)
        batch = make_batch()
        got = _adapter_grads(w, batch)
        live = adapters.gather_params(w.policy, adapter_only=False, keep=True)  # dequantised
        ref = get_peft_model(_plain(tiny_model), adapters.lora_config(w.s.adapter))
        missing, unexpected = ref.load_state_dict(live, strict=False)
        assert not unexpected and missing == ["base_model.model.lm_head.weight"]  # tied
        ref.train()
        lp = sequence_logprobs(ref, batch.input_ids, batch.attention_mask, batch.response_start)
        (lp * batch.advantages).sum().backward()
        for n, p in ref.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    finally:
        w.close()


def test_lora_reference_is_the_base_and_dpo_loss_matches_by_hand(tiny_model, tmp_path):
    from peft import PeftModel

    beta = 0.1
    w = _one_rank(
        tiny_model, "lora", "float32", load_reference=True, algorithm="dpo", loss=DPOLoss(beta=beta)
    )
    try:
        _randomise_adapter(w)
        batch = make_batch()  # rows (0, 1) and (2, 3): chosen/rejected pairs
        base = _plain(tiny_model)
        with torch.no_grad():
            base_lp = (
                sequence_logprobs(base, batch.input_ids, batch.attention_mask, batch.response_start)
                * batch.response_mask
            )
        ref_lp = w.compute(batch, 0, "ref_logprobs")
        pol_lp = w.compute(batch, 0, "old_logprobs")
        torch.testing.assert_close(ref_lp, base_lp, rtol=0, atol=1e-5)
        assert (pol_lp - ref_lp).abs().max() > 1e-2  # the adapter does change the policy
        # DPO: the learner's reference sums are the base's, its loss the formula's
        ref_sums = w.compute(batch, 0, "ref_logprobs").sum(-1)
        w.free_reference()  # nothing to free with an adapter; still usable
        torch.testing.assert_close(w.compute(batch, 0, "ref_logprobs").sum(-1), ref_sums)
        torch.testing.assert_close(w.compute(batch, 0, "old_logprobs").sum(-1), pol_lp.sum(-1))
        rc, rr = base_lp.sum(-1)[0::2], base_lp.sum(-1)[1::2]
        pc, pr = pol_lp.sum(-1)[0::2], pol_lp.sum(-1)[1::2]
        want = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
        batch.ref_sums, batch.loss_denominator = ref_sums, 2.0
        stats = w.train_step(batch, step=0)
        assert stats["loss"] == pytest.approx(want.item(), abs=1e-6)
        # the saved adapter loads onto the base with peft and gives the learner's logprobs
        w.save_checkpoint(str(tmp_path / "final"), step=1)
        after = w.compute(batch, 1, "old_logprobs")
        loaded = PeftModel.from_pretrained(_plain(tiny_model), str(tmp_path / "final")).eval()
        with torch.no_grad():
            peft_lp = (
                sequence_logprobs(
                    loaded, batch.input_ids, batch.attention_mask, batch.response_start
                )
                * batch.response_mask
            )
        torch.testing.assert_close(peft_lp, after, rtol=0, atol=1e-5)
    finally:
        w.close()


def test_unknown_target_module_names_the_key(tiny_model):
    with pytest.raises(ValueError, match=r"model\.adapter\.target_modules: \['qkv_proj'\]"):
        adapters.check_targets(str(tiny_model), ("q_proj", "qkv_proj"))
    adapters.check_targets(str(tiny_model), adapters.DEFAULT_TARGETS)


def test_nf4_blocks_split_over_ranks():
    assert nf4_block_sizes((576, 576), 1) == (64, 64)  # 5184 blocks = 81 x 64
    assert nf4_block_sizes((576, 576), 2) == (64, 32)
    assert nf4_block_sizes((1536, 576), 2) == (64, 256)
    with pytest.raises(ValueError, match="model.adapter.type qlora"):
        nf4_block_sizes((3, 5), 2)


def test_dora_step_and_merged_weights_give_the_learners_logprobs(tiny_model):
    w = LearnerWorker(
        0,
        1,
        LearnerSettings(
            model_path=str(tiny_model),
            compute_dtype="float32",
            lr=1e-2,
            micro_batch_size=2,
            adapter=AdapterSettings(type="lora", r=R, alpha=ALPHA, use_dora=True),
        ),
        threads=2,
    )
    w.setup(free_port())
    try:
        _randomise_adapter(w)
        batch = make_batch()
        batch.old_logprobs = w.compute(batch, 0, "old_logprobs")
        batch.loss_denominator = loss_denominator(batch.response_mask, "token_mean")
        stats = w.train_step(batch, 0)
        assert math.isfinite(stats["loss"])
        plain = _plain(tiny_model)
        plain.load_state_dict(w._full_state_dict())
        with torch.no_grad():
            merged_lp = (
                sequence_logprobs(
                    plain, batch.input_ids, batch.attention_mask, batch.response_start
                )
                * batch.response_mask
            )
        torch.testing.assert_close(
            merged_lp, w.compute(batch, 1, "old_logprobs"), rtol=0, atol=1e-5
        )
    finally:
        w.close()
