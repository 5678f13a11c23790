"""LoRA, QLoRA and DoRA adapters on the learner's policy, through `peft`.

Structure, in the order the learner applies it (before FSDP2's `fully_shard`):
1. `check_targets`: the recipe's `target_modules` against the model's linear layers,
   on a meta-device copy (no weights read), so a typo fails before anything loads.
2. `wrap_policy`: `peft.get_peft_model` puts LoRA on the targeted linear layers
   (Hu et al. 2021, eq. 3: `h = W0 x + (alpha / r) B A x`, `A [r, in]`, `B [out, r]`,
   B initialised to 0). Only the adapter tensors require grad; they are stored in
   float32 (AdamW master weights) and cast to the compute dtype by FSDP2. The frozen
   rest of the model is stored in the compute dtype (it never receives an update).
   DoRA (Liu et al. 2024) adds peft's per-output-channel magnitude vector.
3. QLoRA (Dettmers et al. 2023, §3): each targeted base weight `W0` is then replaced
   by a torchao `NF4Tensor`: 4-bit NormalFloat codes in blocks of `block` values with
   one absmax scale per block, the scales themselves quantised to int8 in blocks of
   `scaler_block` (double quantisation). Forward and backward dequantise `W0` to the
   input's dtype (`torchao`'s `LinearNF4`), so LoRA's gradients are those of the
   dequantised base. torchao's NF4 is used on every device: bitsandbytes' CPU NF4
   repacks its weights after an eval-mode forward under `no_grad` (a logprob pass) and
   later LoRA gradients come out wrong without an error (tests/test_adapters.py
   checks the trap on this backend).

Reference model: the policy with the adapter disabled (`PeftModel.disable_adapter`),
never a second copy. Merging (weight push, merged checkpoint) happens on a temporary
rank-0 copy built from gathered full tensors, dequantised to float32, never on the
learner's own modules, whose adapter stays as it is.

Limits: only `torch.nn.Linear` layers are targeted; NF4 needs each targeted matrix's
rows, blocks and scale blocks to split evenly over the learner ranks (FSDP2 shards
dim 0), else `nf4_block_sizes` raises.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..common.score_head import pooling_pad_id

ADAPTER = "default"  # peft's name of the one adapter the learner trains
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSettings:
    """Plain values of the recipe's `model.adapter` block (see config/adapter.py)."""

    type: str = "none"  # none | lora | qlora
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    use_dora: bool = False
    save_merged: bool = False

    @property
    def enabled(self) -> bool:
        return self.type != "none"


def _import_torchao_nf4():  # noqa: ANN202 (a module-level lazy import)
    # torchao logs a warning per CUDA kernel library it cannot load on a CPU machine.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def lora_config(
    s: AdapterSettings,
    base_model_path: str | None = None,  # noqa: ANN201
    head: str = "lm",
):
    """The `peft.LoraConfig` of these settings (no bias training): task CAUSAL_LM, or for
    a scalar-head model (`head='score'`) SEQ_CLS with the `score` head fully trained
    (`modules_to_save`)."""
    from peft import LoraConfig

    score = head == "score"
    return LoraConfig(
        r=s.r,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=list(s.target_modules),
        use_dora=s.use_dora,
        bias="none",
        task_type="SEQ_CLS" if score else "CAUSAL_LM",
        base_model_name_or_path=base_model_path,
        modules_to_save=["score"] if score else None,
    )


def check_targets(model_path: str, targets: tuple[str, ...]) -> None:
    """Check every target name against the linear layers of the model at `model_path`,
    on a meta-device copy built from its config (no weights are read).

    Raises:
        ValueError: a name matches no `torch.nn.Linear` (peft would silently skip it);
            the message names `model.adapter.target_modules` and lists the valid names.
            Or `lm_head` is targeted on a model whose head is tied to its embedding
            (`config.adapter.tied_head_problem`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise ValueError(
            f"model.adapter.target_modules: {unknown} name no linear layer of {model_path}; "
            f"its linear layers are {sorted(names)}"
        )
    from ..config.adapter import tied_head_problem  # pydantic only, no torch

    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and out.weight is inp.weight
    if problem := tied_head_problem(targets, tied, model_path):
        raise ValueError(problem)


def nf4_block_sizes(shape: tuple[int, int], world: int) -> tuple[int, int]:
    """`(block, scaler_block)` for storing a `[out, in]` weight in NF4 over `world`
    FSDP2 ranks: the QLoRA paper's 64 and 256 when they fit, else the largest powers of
    two below them such that the rows, the `out·in / block` blocks and the scale blocks
    all split evenly over the ranks (FSDP2 shards dim 0 of the NF4 codes, block scales
    and scale factors alike). E.g. SmolLM2's `[576, 576]` over 2 ranks: (64, 32).

    Raises:
        ValueError: no block size fits (rows not divisible by `world`, or `out·in`
            not divisible by 2·world).
    """
    out, inp = shape
    numel = out * inp
    if out % world == 0:
        for block in (64, 32, 16, 8, 4, 2):
            if numel % (block * world):
                continue
            blocks = numel // block
            for scaler in (256, 128, 64, 32, 16, 8, 4, 2, 1):
                if blocks % (scaler * world) == 0:
                    return block, scaler
    raise ValueError(
        f"model.adapter.type qlora: a [{out}, {inp}] weight cannot be split into NF4 blocks "
        f"evenly over {world} learner workers; use type: lora, or a learner size that "
        f"divides {out}"
    )


def quantize_base(model: torch.nn.Module, world: int) -> int:
    """Replace the base weight of every LoRA-wrapped linear layer of a peft `model`
    by a frozen torchao `NF4Tensor` (double-quantised), in place. Returns how many.

    Raises:
        ValueError: a weight's shape does not split into NF4 blocks over `world` ranks.
    """
    from peft.tuners.lora import LoraLayer

    _, to_nf4 = _import_torchao_nf4()
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module.base_layer, torch.nn.Linear):
            base = module.base_layer
            block, scaler = nf4_block_sizes(tuple(base.weight.shape), world)
            nf4 = to_nf4(base.weight.detach().float().contiguous(), block, scaler)
            base.weight = torch.nn.Parameter(nf4, requires_grad=False)
            count += 1
    return count


def wrap_policy(
    model: torch.nn.Module,
    s: AdapterSettings,
    world: int,
    frozen_dtype: torch.dtype,
    head: str = "lm",
) -> torch.nn.Module:
    """Put `s`'s adapter on a float32 transformers causal LM (before FSDP2); returns the
    `PeftModel`. Adapter tensors stay float32 and trainable; every other parameter is
    frozen, targeted base weights become NF4 for QLoRA, the rest is cast to
    `frozen_dtype`."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(s, model.name_or_path, head))
    if s.type == "qlora":
        quantize_base(peft_model, world)
    NF4Tensor, _ = _import_torchao_nf4()
    for p in peft_model.parameters():
        if not p.requires_grad and not isinstance(p, NF4Tensor):
            p.data = p.data.to(frozen_dtype)
    return peft_model


def fsdp_ignored_params(model: torch.nn.Module, world: int) -> set[torch.nn.Parameter]:
    """Parameters FSDP2 must leave alone: the NF4 weights when there is one rank.

    torch 2.13's single-rank FSDP2 shortcut copies only the first all-gather input of a
    tensor subclass, and an `NF4Tensor` has three (codes, block scales, scale factors),
    so unsharding fails; with one rank sharding saves nothing anyway."""
    if world != 1:
        return set()
    NF4Tensor, _ = _import_torchao_nf4()
    return {p for p in model.parameters() if isinstance(p, NF4Tensor)}


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM, with or without a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def _dequantize(t: torch.Tensor) -> torch.Tensor:
    NF4Tensor, _ = _import_torchao_nf4()
    return t.get_original_weight() if isinstance(t, NF4Tensor) else t


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter, NF4 dequantised; a
    collective when sharded. Each rank dequantises its own shard (block-aligned by
    `nf4_block_sizes`), so only plain tensors cross the group."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = _dequantize(p.to_local())
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
    return _dequantize(p.detach())


def gather_params(
    model: torch.nn.Module, adapter_only: bool, keep: bool
) -> dict[str, torch.Tensor]:
    """Full float tensors of `model`'s parameters under their peft names (NF4 bases
    dequantised), or only the adapter's when `adapter_only`. Collective: every rank
    calls it; tensors are kept (on CPU) only where `keep`, e.g. on rank 0."""
    out = {}
    for name, p in model.named_parameters():
        if adapter_only and not p.requires_grad:
            continue
        full = _full(p)
        if keep:
            out[name] = full.detach().cpu().clone()
    return out


def peft_adapter_state(
    model: torch.nn.Module, gathered: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """PEFT-format adapter tensors (as `get_peft_model_state_dict` gives them, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) from gathered
    full tensors with the live model's names."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)


def config_dict(model: torch.nn.Module) -> dict:
    """The live adapter's `LoraConfig` as plain JSON-able values (sets as sorted lists,
    enums as their values)."""
    raw = model.peft_config[ADAPTER].to_dict()
    return {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in raw.items()}


def _temp_peft(
    gathered: dict[str, torch.Tensor], model_path: str, s: AdapterSettings, head: str
) -> torch.nn.Module:
    """A temporary peft model on the meta device holding `gathered` by assignment (float32,
    tied weights re-tied); the learner's own modules are not touched."""
    from peft import get_peft_model

    plain = meta_model(model_path, head)
    temp = get_peft_model(plain, lora_config(s, head=head), low_cpu_mem_usage=True)
    temp.load_state_dict({k: v.float() for k, v in gathered.items()}, assign=True, strict=False)
    temp.get_base_model().tie_weights()
    return temp


def merged_state_dict(
    gathered: dict[str, torch.Tensor], model_path: str, s: AdapterSettings, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """Plain transformers weights (`model.layers.0.self_attn.q_proj.weight`,
    `lm_head.weight` tied to the embedding, ...) with the adapter merged in float32:
    `W = dequant(W0) + (alpha / r) B A` (LoRA), or DoRA's magnitude-rescaled sum.

    Built on a temporary meta-device peft model that takes `gathered` (the output of
    `gather_params(..., adapter_only=False)`) by assignment, then peft's
    `merge_and_unload`; the learner's own modules are not touched.
    """
    merged = _temp_peft(gathered, model_path, s, head).merge_and_unload()
    merged.tie_weights()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def base_state_dict(
    gathered: dict[str, torch.Tensor], model_path: str, s: AdapterSettings, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """Plain transformers weights of the base the adapter is applied to: the frozen
    weights, NF4 dequantised, float32, *without* the adapter (peft's `unload`). What an
    engine serving base + adapter must hold (adapter-only sync): a base with the adapter
    merged in would have it applied twice, `W0 + 2 (alpha / r) B A`."""
    base = _temp_peft(gathered, model_path, s, head).unload()
    base.tie_weights()
    return {k: v.detach() for k, v in base.state_dict().items()}


def plain_base_name(name: str) -> str | None:
    """The checkpoint name of a live peft parameter of the base
    (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` ->
    `model.layers.0.self_attn.q_proj.weight`); None for the adapter's own tensors
    (`lora_*`, `modules_to_save` copies)."""
    parts = name.removeprefix("base_model.model.").split(".")
    if any(p.startswith("lora_") or p == "modules_to_save" for p in parts):
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def meta_model(model_path: str, head: str = "lm") -> torch.nn.Module:
    """A float32 model of `model_path`'s config on the meta device (no weights read): the
    causal LM, or with `head='score'` the one-label sequence classifier (pad_token_id
    `common.score_head.pooling_pad_id`, as `learner.models.load_score_model` sets it)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    config = AutoConfig.from_pretrained(model_path)
    if head == "score":
        config.num_labels = 1
        config.pad_token_id = pooling_pad_id(
            AutoTokenizer.from_pretrained(model_path), config.pad_token_id, config.eos_token_id
        )
    cls = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(config, dtype=torch.float32)


def memory_report(model: torch.nn.Module, reference: torch.nn.Module | None) -> dict[str, int]:
    """Learner memory at start, over all ranks (collective; equal on every rank).

    Keys: `trainable_params` (count); `frozen_params` (count); `frozen_bytes` (bytes
    the frozen policy weights take, NF4 codes and scales included, plus a separate
    reference copy when one is loaded); `frozen_bytes_bf16` (the same weights at 2
    bytes each); `trainable_bytes` (float32 master copies); `optimizer_bytes` (AdamW's
    two float32 moments per trainable value, allocated at the first step).
    """
    from torch.distributed.tensor import DTensor

    NF4Tensor, _ = _import_torchao_nf4()

    def local_bytes(p: torch.Tensor) -> int:
        t = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(t, NF4Tensor):
            inner = (t.quantized_scalers, t.quantization_factor, t.quantized_data)
            return sum(x.numel() * x.element_size() for x in inner)
        return t.numel() * t.element_size()

    frozen = [p for p in model.parameters() if not p.requires_grad]
    if reference is not None:
        frozen += list(reference.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    local = torch.tensor([sum(local_bytes(p) for p in frozen)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(local)
    n_train = sum(math.prod(p.shape) for p in trainable)  # global shapes
    n_frozen = sum(math.prod(p.shape) for p in frozen)
    return {
        "trainable_params": n_train,
        "frozen_params": n_frozen,
        "frozen_bytes": int(local.item()),
        "frozen_bytes_bf16": 2 * n_frozen,
        "trainable_bytes": 4 * n_train,
        "optimizer_bytes": 8 * n_train,
    }


def format_memory_report(r: dict[str, int]) -> str:
    """One console line of `memory_report`, in MiB."""
    mib = 1 << 20
    line = (
        f"learner memory: trainable {r['trainable_params']:,} params "
        f"({r['trainable_bytes'] / mib:.1f} MiB fp32, AdamW state "
        f"{r['optimizer_bytes'] / mib:.1f} MiB)"
    )
    if not r["frozen_params"]:  # full fine-tuning: nothing frozen to report
        return line
    return (
        f"{line}; frozen {r['frozen_params']:,} params {r['frozen_bytes'] / mib:.1f} MiB "
        f"(bf16 would be {r['frozen_bytes_bf16'] / mib:.1f} MiB)"
    )
