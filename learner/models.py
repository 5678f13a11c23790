"""Building the learner's models: one sharding helper for the policy, the reference
and the critic, and their forwards (logprobs, values, reward-model scores).

Every decoder layer and then the root module are wrapped with `fully_shard`;
parameters are stored (and AdamW runs) in float32 and cast to the compute dtype for
forward/backward by FSDP2's `MixedPrecisionPolicy`, with gradients reduced in float32.
Storing bf16 weights instead makes small updates vanish: at lr 1e-6 most of an AdamW
step is below bf16's spacing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ..algorithms.batch import TrainBatch
from ..common.score_head import pooling_pad_id, sequence_scores
from . import adapters
from .adapters import AdapterSettings
from .optimizer import adamw
from .settings import LearnerSettings, lr_factor

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _load_float32(
    path: str, kind: Literal["policy", "reference", "critic"], head: Literal["lm", "score"]
) -> torch.nn.Module:
    """The float32 transformers model `load_sharded` shards (no KV cache): a critic's
    token-classification head, a reward model's score head, else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if kind == "critic":
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32
        )
    elif kind == "policy" and head == "score":
        model = load_score_model(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def load_sharded(
    path: str,
    world: int,
    dtype: str,
    kind: Literal["policy", "reference", "critic"],
    adapter: AdapterSettings | None = None,
    checkpointing: bool = False,
    device_type: str = "cpu",
    head: Literal["lm", "score"] = "lm",
    compile_layers: bool = False,
    lora_a_columns: bool = False,
) -> torch.nn.Module:
    """A float32 model from `path`, sharded over the process group with FSDP2 on a
    `device_type` mesh ('cpu', or 'cuda': FSDP2 moves each shard to the current CUDA
    device). The mesh is explicit: FSDP2's default follows the machine's accelerator,
    which would put a `device: cpu` rank on a GPU machine onto CUDA.

    Args:
        kind: 'policy' (trainable; with `adapter`, a peft LoRA/QLoRA model), 'reference'
            (frozen, eval mode) or 'critic' (the architecture with a scalar head,
            `AutoModelForTokenClassification` with one label; trainable).
        head: the policy's head: 'lm' (causal LM) or 'score' (a reward model,
            `load_score_model`).
        dtype: compute dtype of forward/backward.
        checkpointing: recompute decoder-layer activations in backward (transformers'
            non-reentrant gradient checkpointing; trainable models only).
        compile_layers: wrap each decoder layer's `forward` in `torch.compile` (inductor;
            C++ on CPU, Triton on CUDA) before sharding, one block at a time as torchtitan
            does, so FSDP2's all-gather hooks stay eager and the state-dict keys do not
            change. The first micro-batch of each new shape kind pays the compile
            (bench/compile.py measures it).
        lora_a_columns: shard each `lora_A [r, in]` on its columns (dim 1) instead of
            its rows, so every rank holds all r rows (learner/session_slot.py).

    Raises:
        ValueError: a QLoRA weight does not split into NF4 blocks over the ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _load_float32(path, kind, head)
    if checkpointing and kind != "reference":
        # Non-reentrant: works under FSDP2 and with frozen inputs (LoRA's base).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = kind == "policy" and adapter is not None and adapter.enabled
    if lora:
        model = adapters.wrap_policy(model, adapter, world, DTYPES[dtype], head)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    ignored = adapters.fsdp_ignored_params(model, world)
    mesh = init_device_mesh(device_type, (world,))
    place = _lora_a_columns(model) if lora_a_columns else None
    for layer in adapters.decoder_layers(model):
        if compile_layers:
            layer.forward = torch.compile(layer.forward)
        fully_shard(
            layer, mesh=mesh, mp_policy=mp, ignored_params=ignored, shard_placement_fn=place
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored, shard_placement_fn=place)
    if lora:
        # FSDP2 fixes each group's reduce dtype from the parameters that require grad
        # at its first forward, and peft's disable_adapter() clears requires_grad: a
        # reference pass first would leave bf16 gradients that fail to reduce into
        # float32 ones. One tiny forward now, adapter on, settles it.
        with torch.no_grad():
            dev = next(model.parameters()).device
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev))
        model.reshard()  # the root stays unsharded after a forward
    if kind == "reference":
        model.requires_grad_(False)
        model.eval()
    return model


@contextmanager
def one_gather_per_step(models: list[torch.nn.Module], world: int) -> Iterator[Callable]:
    """FSDP2 around the micro-batches of one optimizer step: yields `micro_batch(last)`,
    called before each micro-batch's forward (`last`: the step's final one).

    On one rank a shard is the whole model, so resharding frees only the bf16 compute
    copy, yet FSDP2 by default casts the float32 weights into it twice a micro-batch
    (forward and backward) and copies each micro-batch's gradients out. Here the copy
    is made once, at the step's first forward, and kept to its last backward;
    gradients accumulate unsharded in float32 (FSDP2's `unsharded_accumulated_grad`,
    the reduce dtype) and go to the shards once, after the last micro-batch. On several
    ranks FSDP2's defaults stay (the unsharded copy would cost each rank the whole
    model). On exit every model reshards after forward again, so a no-grad pass
    between optimizer steps never keeps a copy an update would make stale.
    """
    from torch.distributed.fsdp import FSDPModule

    if world != 1:
        yield lambda last: None
        return

    def micro_batch(last: bool) -> None:
        for m in models:
            m.set_reshard_after_forward(False)
            m.set_requires_gradient_sync(last)
            m.set_reshard_after_backward(last)

    try:
        yield micro_batch
    finally:
        for m in models:
            m.set_reshard_after_forward(True)
            m.set_requires_gradient_sync(True)
            m.set_reshard_after_backward(True)
            for mod in m.modules():  # a step cut short must not leave a copy behind
                if isinstance(mod, FSDPModule):
                    mod.reshard()


def _lora_a_columns(model: torch.nn.Module):  # noqa: ANN202
    """FSDP2's `shard_placement_fn`: `Shard(1)` for the LoRA A matrices, default else."""
    from torch.distributed.tensor import Shard

    columns = {id(p) for n, p in model.named_parameters() if ".lora_A." in n}
    return lambda p: Shard(1) if id(p) in columns else None


def critic_values(critic: torch.nn.Module, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's values of a micro-batch.

    Returns:
        `values [b, T]`: column t is V(s_t), read where token t is predicted (position
        t−1), 0 before `response_start`; and `final [b]`: V(s_T), the value after each
        row's last real token (read at that token's position), which a truncated
        response bootstraps from.
    """
    positions = (mb.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = (
        critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=positions)
        .logits[..., 0]
        .float()
    )
    values = torch.zeros(mb.input_ids.shape, dtype=torch.float32, device=out.device)
    values[:, mb.response_start :] = out[:, mb.response_start - 1 : -1]
    cols = torch.arange(mb.input_ids.shape[1], device=out.device).expand_as(mb.attention_mask)
    last = torch.where(mb.attention_mask > 0, cols, torch.zeros_like(cols)).max(-1).values
    return values, out.gather(1, last[:, None]).squeeze(1)


def load_score_model(path: str) -> torch.nn.Module:
    """The architecture of `path` with a scalar head (`AutoModelForSequenceClassification`,
    one label; a causal LM's body is kept and its `score` head freshly initialised), float32.

    Its config's `pad_token_id` is `common.score_head.pooling_pad_id` (never an EOS id),
    the one the saved folder carries, so plain transformers' pooling reads where
    `reward_scores` does.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    pad = pooling_pad_id(
        AutoTokenizer.from_pretrained(path), config.pad_token_id, config.eos_token_id
    )
    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, pad_token_id=pad
    )


def reward_scores(model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
    """`[b]` float32 scores of a micro-batch under a scalar-head model: the head at each
    row's last attended token (`common.score_head.sequence_scores`, which the reward
    service reads too), whatever the pad id; positions count real tokens only."""
    return sequence_scores(model, mb.input_ids, mb.attention_mask)


@dataclass
class LearnerModels:
    """One rank's sharded models and what trains them (`load_models`)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    optimizers: list[torch.optim.Optimizer]  # the policy's, then the critic's
    scheduler: torch.optim.lr_scheduler.LambdaLR  # the policy's learning rate


def load_models(s: LearnerSettings, world: int, device_type: str) -> LearnerModels:
    """The policy (with its adapter), the frozen reference when the algorithm asks for one,
    the critic when it has one, each sharded over `world` ranks on `device_type`, with
    their AdamW optimizers and the policy's warmup schedule (`lr_factor`).

    Raises:
        ValueError: a QLoRA weight does not split into NF4 blocks over the ranks.
    """
    policy = load_sharded(
        s.model_path,
        world,
        s.compute_dtype,
        "policy",
        s.adapter,
        checkpointing=s.gradient_checkpointing,
        device_type=device_type,
        head=s.head,
        compile_layers=s.compile,
    )
    # With an adapter the reference is the policy with its adapter off, unless it
    # has its own folder (a distillation teacher).
    own = s.reference_path is not None
    load_ref = s.load_reference and (own or not s.adapter.enabled)
    reference = (
        load_sharded(
            s.reference_path or s.model_path,
            world,
            s.compute_dtype,
            "reference",
            device_type=device_type,
            compile_layers=s.compile,
        )
        if load_ref
        else None
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizers = [adamw(trainable, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)]
    critic = None
    if s.critic is not None:
        critic = load_sharded(
            s.critic.path or s.model_path,
            world,
            s.compute_dtype,
            "critic",
            device_type=device_type,
        )
        optimizers.append(adamw(list(critic.parameters()), lr=s.critic.lr, betas=s.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizers[0], partial(lr_factor, warmup_steps=s.warmup_steps)
    )
    return LearnerModels(policy, reference, critic, optimizers, scheduler)
