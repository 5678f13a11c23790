"""Capacity planning: memory, traffic and time of a run from first principles.

Pure functions of numbers, no torch: every formula names its unit (bytes, FLOPs,
seconds; GB = 1e9 bytes) and where it comes from. `posttrain plan` (recipes/planning/planner.py)
feeds them a recipe and a model's config.json; tests/recipes/test_plan.py checks them
against the worked figures of ../shared/capacity-figures.md.

Limits: these are first-order estimates. They ignore allocator fragmentation, CUDA
context and NCCL buffers (a few GB per device), kernel efficiency beyond the MFU you
give, prefill time, and latency terms of collectives (2(n-1)·alpha for a ring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9

# --- hardware -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One accelerator's datasheet numbers (SXM parts, dense bf16, no sparsity).

    Attributes:
        hbm_bytes: device memory, bytes (datasheet "GB").
        hbm_bytes_per_s: HBM bandwidth, bytes/s.
        bf16_flops: peak dense bf16 tensor-core rate, FLOP/s.
        nvlink_bytes_per_s: NVLink bandwidth per GPU, bytes/s (both directions summed,
            as the datasheet states it; a one-way transfer gets half,
            `nvlink_one_way_bytes_per_s`).
        network_bytes_per_s: inter-node bandwidth per GPU (one NIC per GPU), bytes/s.
        source: where the numbers come from.
    """

    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    source: str

    @property
    def nvlink_one_way_bytes_per_s(self) -> float:
        """NVLink bytes/s in one direction: half the datasheet's bidirectional figure
        (H100: 900 GB/s total = 18 links × 25 GB/s each way), what a broadcast from one
        GPU can send."""
        return self.nvlink_bytes_per_s / 2


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        80 * GB,
        3.35e12,
        989e12,
        900 * GB,
        400e9 / 8,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB HBM3, 3.35 TB/s, "
        "989 TFLOPS bf16 dense, NVLink 900 GB/s); ConnectX-7 NDR 400 Gb/s per GPU",
    ),
    "h200": Hardware(
        141 * GB,
        4.8e12,
        989e12,
        900 * GB,
        400e9 / 8,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
        "989 TFLOPS bf16 dense, NVLink 900 GB/s); ConnectX-7 NDR 400 Gb/s per GPU",
    ),
    "a100": Hardware(
        80 * GB,
        2.039e12,
        312e12,
        600 * GB,
        200e9 / 8,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: 2,039 GB/s, "
        "312 TFLOPS bf16 dense, NVLink 600 GB/s); ConnectX-6 HDR 200 Gb/s per GPU",
    ),
}

# --- learner memory -------------------------------------------------------------------

# Mixed-precision AdamW (Rajbhandari et al. 2020, ZeRO, §3.1: "2Ψ + 2Ψ + KΨ", K = 12):
# bf16 weights 2 + bf16 grads 2 + fp32 master 4 + fp32 first and second moments 4 + 4.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12  # K: fp32 master + two fp32 moments
ADAM_BYTES_PER_PARAM = WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES  # 16


def training_state_bytes(params: float) -> float:
    """Bytes of weights, grads, fp32 master and AdamW moments, unsharded: 16 B/param
    (ZeRO §3.1). 7e9 params -> 112e9 bytes, before activations."""
    return ADAM_BYTES_PER_PARAM * params


def zero_bytes_per_rank(params: float, ranks: int, stage: int) -> float:
    """Bytes of training state per rank under ZeRO / FSDP (ZeRO §5, Fig. 1).

    Stage 0 (DDP) 16Ψ; stage 1 shards the optimizer: 4Ψ + 12Ψ/N; stage 2 also the
    grads: 2Ψ + 14Ψ/N; stage 3 (FSDP full shard) everything: 16Ψ/N.
    """
    if ranks < 1 or stage not in (0, 1, 2, 3):
        raise ValueError(f"ranks must be >= 1 and stage 0..3, got {ranks}, {stage}")
    w, g, k = WEIGHT_BYTES * params, GRAD_BYTES * params, OPTIMIZER_BYTES * params
    return {0: w + g + k, 1: w + g + k / ranks, 2: w + (g + k) / ranks, 3: (w + g + k) / ranks}[
        stage
    ]


def zero_wire_elements(params: float, stage: int) -> float:
    """Elements each rank moves per step (ZeRO §7): stages 0-2 an all-reduce of the grads,
    2Ψ (reduce-scatter + all-gather); stage 3 adds an all-gather of the parameters in
    the forward and again in the backward: 3Ψ, 1.5x DDP."""
    return 3 * params if stage == 3 else 2 * params


def nf4_scale_bits(double_quant: bool = True, block: int = 64, block2: int = 256) -> float:
    """Bits per parameter of NF4 block scales (Dettmers et al. 2023, QLoRA §3): one fp32
    absmax per 64 weights is 32/64 = 0.5; double quantisation stores them in 8 bits with an
    fp32 constant per 256 of them: 8/64 + 32/(64·256) = 0.127."""
    if not double_quant:
        return 32 / block
    return 8 / block + 32 / (block * block2)


def frozen_base_bytes(params: float, quant: str = "bf16", double_quant: bool = True) -> float:
    """Bytes of a frozen base: bf16 2 B/param, or NF4 4 bits + its block scales (QLoRA §3).
    70e9 params: 140e9 bytes bf16, 35e9 in NF4 before scales."""
    if quant == "bf16":
        return WEIGHT_BYTES * params
    if quant == "nf4":
        return params * (4 + nf4_scale_bits(double_quant)) / 8
    raise ValueError(f"quant must be 'bf16' or 'nf4', got {quant!r}")


def adapter_bytes_per_rank(
    base_params: float, adapter_params: float, ranks: int, quant: str = "bf16"
) -> float:
    """LoRA / QLoRA state per rank with everything sharded over `ranks` (FSDP2): the frozen
    base (no grads, no optimizer) plus the adapter at 16 B/param."""
    return (frozen_base_bytes(base_params, quant) + training_state_bytes(adapter_params)) / ranks


def activation_bytes_per_layer(
    seq: int, batch: int, hidden: int, heads: int, scores: bool = False
) -> float:
    """Activation bytes one transformer layer keeps for the backward, 16-bit, no tensor
    parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1):
    s·b·h·(34 + 5·a·s/h). With fused attention (flash / SDPA) the a·s² score terms are
    never stored, leaving 34·s·b·h (the paper's selective recomputation, §4.2).
    128k tokens, h = 16384 (Llama 3 405B): 73 GB per sequence per layer."""
    per = 34.0 + (5.0 * heads * seq / hidden if scores else 0.0)
    return seq * batch * hidden * per


def activation_bytes(
    layers: int, seq: int, batch: int, hidden: int, heads: int, vocab: int, checkpointing: bool
) -> float:
    """Peak activation bytes of one micro-batch: every layer (eq. 1, fused attention), or
    with full activation checkpointing only each layer's 16-bit input, 2·s·b·h, plus one
    layer recomputed (Korthikanti §4.1); plus the fp32 logits, 4·s·b·V."""
    one = activation_bytes_per_layer(seq, batch, hidden, heads)
    body = layers * 2 * seq * batch * hidden + one if checkpointing else layers * one
    return body + 4 * seq * batch * vocab


# --- rollout engine -------------------------------------------------------------------


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, tokens: float, bytes_per_value: int = 2
) -> float:
    """KV cache bytes: 2 (K and V) × layers × kv_heads × head_dim × bytes × tokens (Pope et
    al. 2022, "Efficiently Scaling Transformer Inference", §2; GQA counts kv heads)."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value * tokens


def decode_seconds(
    weight_bytes: float,
    kv_bytes_per_token: float,
    sequences: int,
    prompt_tokens: int,
    new_tokens: int,
    hbm_bytes_per_s: float,
) -> float:
    """Time to decode `new_tokens` for a batch of `sequences` when memory-bandwidth bound
    (Pope et al. 2022, §3): each step reads all weights once plus every sequence's KV cache
    so far; summed over steps with the cache's mean length prompt + new/2."""
    mean_ctx = prompt_tokens + new_tokens / 2
    per_step = weight_bytes + kv_bytes_per_token * sequences * mean_ctx
    return new_tokens * per_step / hbm_bytes_per_s


# --- collectives ----------------------------------------------------------------------


def ring_allreduce_bytes(buffer_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(n-1)/n × buffer
    (Patarasuk & Yuan 2009, bandwidth-optimal). 16 GB at n = 8 -> 28 GB."""
    return 2 * (n - 1) / n * buffer_bytes


def broadcast_bytes(params: float, bytes_per_param: int = WEIGHT_BYTES) -> float:
    """Bytes of one weight push learner -> rollout: the whole policy in its dtype.
    70.6e9 params (Llama 3 70B) in bf16: 141 GB."""
    return params * bytes_per_param


def transfer_seconds(nbytes: float, bytes_per_s: float) -> float:
    """Seconds to move `nbytes` at `bytes_per_s` (bandwidth term only; a pipelined ring
    broadcast approaches this for large buffers)."""
    return nbytes / bytes_per_s


# --- compute --------------------------------------------------------------------------


def training_flops(params: float, tokens: float, recompute: bool = False) -> float:
    """FLOPs of training on `tokens`: 6·N·D (Kaplan et al. 2020, §2.1: forward 2N, backward
    4N per token), attention ignored; full activation recompute adds one forward: 8·N·D
    (+33%). 400e9 params on 10e12 tokens: 2.4e25."""
    return (8 if recompute else 6) * params * tokens


def compute_seconds(flops: float, devices: int, peak_flops: float, mfu: float) -> float:
    """Wall time of `flops` on `devices` at a model-FLOPs utilisation `mfu` (Chowdhery et al.
    2022, PaLM, App. B: MFU = model FLOPs / (time × peak))."""
    return flops / (devices * peak_flops * mfu)


def mfu(
    params: float, tokens: float, step_seconds: float, devices: int, peak_flops: float
) -> float:
    """Model FLOPs utilisation of a measured step (PaLM App. B), 6·N·tokens per step."""
    return training_flops(params, tokens) / (step_seconds * devices * peak_flops)


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of compute time in a GPipe / 1F1B pipeline: (p-1)/m (Narayanan et al.
    2021, Megatron-LM, §2.2.1)."""
    return (stages - 1) / micro_batches


def hot_expert_load(token_fraction: float, hot_experts: int, experts: int) -> float:
    """Load of each of `hot_experts` receiving `token_fraction` of tokens, relative to an
    even share 1/experts (MoE imbalance). 90% to 26 of 256 -> ~8.9x."""
    return (token_fraction / hot_experts) * experts


# --- failures -------------------------------------------------------------------------


def mtbf_seconds(days: float, interruptions: int) -> float:
    """Mean time between failures of a fleet: elapsed time / interruptions, seconds.
    Llama 3: 54 days, 419 unexpected interruptions -> ~3.1 h."""
    return days * 86400 / interruptions


def young_daly_interval(checkpoint_seconds: float, mtbf_s: float) -> float:
    """Checkpoint interval minimising lost work, sqrt(2·δ·MTBF), seconds (Young 1974; Daly
    2006 first order), δ the time to write one checkpoint."""
    return math.sqrt(2 * checkpoint_seconds * mtbf_s)


def restart_overhead(restarts_per_day: float, restart_seconds: float) -> float:
    """Fraction of wall time lost to restarts: 2 a day at 15 min each -> 2.1%."""
    return restarts_per_day * restart_seconds / 86400


# --- number formats -------------------------------------------------------------------


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format (IEEE 754-2008 §3.3 layout; OCP FP8 spec 2023 for
    E4M3, which has no infinities and keeps only mantissa all-ones as NaN at the top
    exponent)."""

    exponent_bits: int
    mantissa_bits: int
    ieee_special: bool = True  # top exponent reserved for inf/NaN

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_finite(self) -> float:
        """Largest finite value: fp16 65,504; E4M3 448."""
        m = self.mantissa_bits
        if self.ieee_special:
            return (2 - 2.0**-m) * 2.0 ** (2**self.exponent_bits - 2 - self.bias)
        return (2 - 2.0 ** -(m - 1)) * 2.0 ** (2**self.exponent_bits - 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, 2^(1 - bias - mantissa_bits): fp16 5.96e-8."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    def spacing(self, x: float) -> float:
        """Gap between `x` (normal, non-zero) and the next representable value:
        2^(floor(log2|x|) - mantissa_bits); bf16 at 1.0: 2^-7 = 0.0078. An update smaller
        than half of it vanishes when added."""
        return 2.0 ** (math.floor(math.log2(abs(x))) - self.mantissa_bits)


FORMATS: dict[str, FloatFormat] = {
    "fp32": FloatFormat(8, 23),
    "fp16": FloatFormat(5, 10),
    "bf16": FloatFormat(8, 7),
    "fp8_e4m3": FloatFormat(4, 3, ieee_special=False),
}
