"""`posttrain plan --gpu cpu`: the quickstart-style step on this machine's cores, from
measured rates (recipes/planning/calibrate.py) and plan.py's formulas. No torch here.

The step is synchronous, as `posttrain run`'s: generate, then train, then push.
- generate: the recipe's own engine (vLLM or transformers) timed on the step's batch
  (one prefill, then decode steps); the prefill scaled by prompt tokens, plus
  `max_new_tokens` decode steps at the probe's seconds per step (scaled by batch). The
  roofline max(weight bytes / bandwidth, 2·N·batch / matmul rate) (Williams et al. 2009,
  "Roofline") is shown beside it; its ratio to the probe is the engine's decode efficiency.
- train, per learner rank: 6·N·tokens (counted as the learner packs a group's rows:
  `learner_tokens`; plus 2·N·tokens of reference forward when the KL
  needs one, times grpo.epochs) at the matmul rate × an MFU measured by the train probe
  (its 6·N·tokens over its seconds, over the matmul rate: PaLM App. B); AdamW at the
  seconds per parameter an AdamW step over the model's own (sharded) tensors took; FSDP2's
  per-micro-batch all-gathers of parameters in `model.dtype` (forward and backward) and
  reduce-scatter of fp32 gradients, (n−1)/n of (2 + 2 + 4)·N bytes in bf16 (ZeRO §7)
  at the loopback rate.
- push: one all-gather per tensor to rank 0 (the measured latency of a small gloo
  all-gather each, plus (n−1)/n·2N bytes; 4N in float32), the broadcast of 2N bytes to
  every engine over loopback, then the engine's own load of the weights (timed on the
  engine: vLLM's CPU backend repacks every linear weight, so it costs several memcpys).
Not modelled: scoring, the controller's own work, ray call latency, early-stopping
samples (every response counts at max_new_tokens), and other jobs on the machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...config import Recipe
from . import formulas as plan
from .planner import step_flops, trained_tokens, weight_bytes


@dataclass(frozen=True)
class DecodeProbe:
    """One short generation of the real model on the recipe's engine (`engine`: 'vllm' or
    'hf'): `batch` sequences of `prompt_tokens` prefilled (`prefill_s` seconds), then
    `steps` one-token decode steps (`step_s` seconds each), at `threads` torch threads."""

    engine: str
    threads: int
    batch: int
    prompt_tokens: int
    steps: int
    prefill_s: float
    step_s: float


@dataclass(frozen=True)
class TrainProbe:
    """One forward + backward of the real model on `tokens` tokens (`batch` rows) at
    `threads` torch threads; `seconds` wall time (kernels built by an untimed call)."""

    threads: int
    batch: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class PushProbe:
    """The parts of a weight push that are not bytes over a link.

    Attributes:
        load_s: seconds the engine took to load all `load_bytes` bytes of weights
            (`InferenceEngine.load_weights`, the tensors already in its process).
        collective_s: seconds of one small all-gather between two gloo ranks on this host
            (a push all-gathers each of the policy's tensors once).
        tensors: tensors one push sends (the policy's, tied aliases left out).
    """

    load_s: float
    load_bytes: float
    collective_s: float
    tensors: int


@dataclass(frozen=True)
class CpuCalibration:
    """What recipes/planning/calibrate.py measured on this machine.

    Attributes:
        matmul_flops: torch threads -> FLOP/s of the model's MLP matmul in `model.dtype`.
        copy_bytes_per_s: bytes read + written per second by a large tensor copy.
        loopback_bytes_per_s: bytes/s through TCP on 127.0.0.1 (gloo's transport here).
        adamw_s_per_param: seconds per trainable parameter of one AdamW step (fp32, the
            model's tensors sharded over the learner ranks, a learner rank's threads).
        seconds: how long the measurements took.
        measured_at: when (ISO 8601, UTC); a cached calibration keeps its own.
    """

    cores: int
    ram_bytes: float
    matmul_flops: dict[int, float]
    copy_bytes_per_s: float
    loopback_bytes_per_s: float
    decode: DecodeProbe
    train: TrainProbe
    push: PushProbe
    adamw_s_per_param: float
    seconds: float
    measured_at: str = ""


@dataclass(frozen=True)
class CpuStep:
    """Predicted seconds of one step by phase, and what they came from."""

    rollout_threads: int
    learner_threads: int
    prefill: float
    decode: float
    decode_roofline: float  # roofline seconds of the same decode steps
    train_compute: float
    optimizer: float
    fsdp_comm: float
    push: float
    mfu: float  # of the train probe, over the matmul rate at the learner's threads

    @property
    def generate(self) -> float:
        return self.prefill + self.decode

    @property
    def train(self) -> float:
        return self.train_compute + self.optimizer + self.fsdp_comm

    @property
    def step(self) -> float:
        return self.generate + self.train + self.push

    @property
    def rollout_idle(self) -> float:
        """Idle share of the rollout worker: it waits while the learner trains (both sides
        take part in the push)."""
        return self.train / self.step

    @property
    def learner_idle(self) -> float:
        """Idle share of the learner ranks: they wait while the engine generates."""
        return self.generate / self.step


def worker_threads(r: Recipe, cores: int) -> tuple[int, int]:
    """Torch threads of a rollout worker and of a learner rank, as `posttrain run` sets
    them (resources.threads_per_worker, else cores / workers of that side, at least 1)."""
    res = r.resources
    engines = res.rollout.engines
    t = res.threads_per_worker
    return (t or max(1, cores // max(1, engines)), t or max(1, cores // res.learner.gpus))


def train_flops_per_token(r: Recipe, params: float) -> float:
    """Training FLOPs per learner token of one step: `planner.step_flops` of the
    algorithm's passes (the critic counted on the same tokens)."""
    return step_flops(r, params, 1.0, 1.0)


def learner_tokens(
    r: Recipe, prompt_tokens: int, hidden: int | None, intermediate: int | None
) -> float:
    """Tokens one learner rank computes per forward pass of a step:
    `planner.trained_tokens` over `resources.learner.gpus` ranks."""
    return trained_tokens(r, prompt_tokens, hidden, intermediate) / r.resources.learner.gpus


def predict(
    r: Recipe,
    params: float,
    trainable: float,
    prompt_tokens: int,
    cal: CpuCalibration,
    hidden: int | None = None,
    intermediate: int | None = None,
) -> CpuStep:
    """One GRPO/PPO step of `r` on this CPU.

    Args:
        params: the policy's parameters N; trainable: those AdamW updates.
        prompt_tokens: the longest prompt after the chat template (all prompts count at it).
        hidden, intermediate: the model's sizes, to count the learner's packed tokens
            (`learner_tokens`); None: no packing.

    Raises:
        ValueError: a DPO recipe (no rollout step).
        KeyError: `cal.matmul_flops` has no rate at a worker's thread count.
    """
    if not r.facts.uses_rollouts:
        raise ValueError(
            f"plan --gpu cpu models rollout steps (generate, train, push); {r.algorithm} "
            "trains on preference pairs"
        )
    t_r, t_l = worker_threads(r, cal.cores)
    width = weight_bytes(r)
    weights = plan.broadcast_bytes(params, width)
    prefill, decode, roof = _rollout_times(r, params, weights, prompt_tokens, cal, t_r)
    tokens_rank = learner_tokens(r, prompt_tokens, hidden, intermediate)
    mfu, compute, optimizer = _learner_compute(r, params, trainable, tokens_rank, cal, t_l)
    comm = _fsdp_comm(r, params, width, cal)
    push = _push_time(r, weights, cal)
    return CpuStep(t_r, t_l, prefill, decode, roof, compute, optimizer, comm, push, mfu)


def _rollout_times(
    r: Recipe, params: float, weights: float, prompt_tokens: int, cal: CpuCalibration, t_r: int
) -> tuple[float, float, float]:
    """An engine's share of the step's sequences, seconds: prefill and decode scaled
    from the engine probe, and the decode roofline (each new token reads the
    `weights` bytes or does 2·N flops per sequence, whichever is slower).

    Raises:
        KeyError: `cal.matmul_flops` has no rate at `t_r` threads.
    """
    res = r.resources
    engines = res.rollout.engines
    seqs = r.train.prompts_per_step * r.rollout.samples_per_prompt
    batch = -(-seqs // engines)
    new = r.rollout.max_new_tokens
    d = cal.decode
    prefill = d.prefill_s * (batch * prompt_tokens) / (d.batch * d.prompt_tokens)
    decode = new * d.step_s * batch / d.batch
    roof = new * max(weights / cal.copy_bytes_per_s, 2 * params * batch / cal.matmul_flops[t_r])
    return prefill, decode, roof


def _learner_compute(
    r: Recipe, params: float, trainable: float, tokens_rank: float, cal: CpuCalibration, t_l: int
) -> tuple[float, float, float]:
    """A learner rank's MFU (the train probe's 6·N flops per token over the matmul
    rate), its forward/backward seconds on `tokens_rank` tokens, and its AdamW seconds.

    Raises:
        KeyError: `cal.matmul_flops` has no rate at `t_l` threads.
    """
    probe_rate = 6 * params * cal.train.tokens / cal.train.seconds
    mfu = probe_rate / cal.matmul_flops[t_l]
    compute = train_flops_per_token(r, params) * tokens_rank / (cal.matmul_flops[t_l] * mfu)
    optimizer = cal.adamw_s_per_param * trainable / r.resources.learner.gpus
    return mfu, compute, optimizer


def _fsdp_comm(r: Recipe, params: float, width: float, cal: CpuCalibration) -> float:
    """FSDP2 traffic of a rank over loopback, seconds: per micro-batch a forward
    gathers the weights (`width` bytes each), a backward gathers them again and
    reduce-scatters fp32 gradients."""
    n_l = r.resources.learner.gpus
    share = (n_l - 1) / n_l
    seqs = r.train.prompts_per_step * r.rollout.samples_per_prompt
    micro = math.ceil(math.ceil(seqs / n_l) / r.train.micro_batch_size)
    p = r.facts.passes
    forwards = p.policy_forward + p.reference_forward + p.critic_forward
    per_params = (2 * width + 4) * (p.policy_train + p.critic_train) + width * forwards
    return micro * share * per_params * params / cal.loopback_bytes_per_s


def _push_time(r: Recipe, weights: float, cal: CpuCalibration) -> float:
    """The weight push, seconds: the learners gather the `weights` bytes (a collective
    per tensor when there are several ranks), send them over loopback, and the engine
    loads them at the probe's rate."""
    n_l = r.resources.learner.gpus
    share = (n_l - 1) / n_l
    pp = cal.push
    gather = (pp.tensors * pp.collective_s if n_l > 1 else 0.0) + (
        share * weights / cal.loopback_bytes_per_s
    )
    return gather + weights / cal.loopback_bytes_per_s + pp.load_s * weights / pp.load_bytes


@dataclass(frozen=True)
class LayoutChoice:
    """The CPU learner's layout: `ranks` processes of `threads` torch threads.

    Attributes:
        seconds: predicted learner seconds of one step per `(ranks, threads)` layout
            (`learner_seconds`); a layout the calibration cannot predict is absent.
        pinned: the recipe sets `resources.learner.gpus` itself.
        reason: one console line: what each layout is predicted to take and why this
            one.
    """

    ranks: int
    threads: int
    seconds: dict[tuple[int, int], float]
    pinned: bool
    reason: str


def learner_seconds(
    r: Recipe,
    params: float,
    trainable: float,
    prompt_tokens: int,
    cal: CpuCalibration,
    ranks: int,
    hidden: int | None = None,
    intermediate: int | None = None,
) -> float | None:
    """Predicted learner seconds of one step of `r` with `ranks` learner ranks of
    `cal.cores // ranks` threads: forward/backward of a rank's tokens at the train
    probe's rate scaled by the matmul rate at those threads over the probe's
    (`rate(t) = probe · matmul[t] / matmul[probe threads]`), AdamW on a rank's share,
    and FSDP2's traffic (`_fsdp_comm`, none on one rank). None when `cal.matmul_flops`
    has no rate at either thread count."""
    threads = max(1, cal.cores // ranks)
    rates = cal.matmul_flops
    if threads not in rates or cal.train.threads not in rates:
        return None
    res = r.resources.model_copy(
        update={"learner": r.resources.learner.model_copy(update={"gpus": ranks})}
    )
    rr = r.model_copy(update={"resources": res})
    probe = 6 * params * cal.train.tokens / cal.train.seconds
    rate = probe * rates[threads] / rates[cal.train.threads]
    tokens = learner_tokens(rr, prompt_tokens, hidden, intermediate)
    compute = train_flops_per_token(rr, params) * tokens / rate
    optimizer = cal.adamw_s_per_param * trainable / ranks
    return compute + optimizer + _fsdp_comm(rr, params, weight_bytes(rr), cal)


#: Predictions within this share of each other are a tie, which the layout with fewer
#: ranks takes (no collectives): the start-up probe's prediction of the same recipe on
#: one machine moved by up to 7% between runs (the quickstart's one rank 4.33-4.64 s,
#: docs/benchmarks.md), and flipped the layout on differences of 2.7% and 3.6%.
LAYOUT_TIE = 0.08


def choose_learner_layout(
    r: Recipe, seconds: dict[tuple[int, int], float], cores: int
) -> LayoutChoice:
    """The faster of the predicted layouts (`seconds`: `(ranks, threads)` -> learner
    seconds of a step), unless the recipe pins `resources.learner.gpus`; a tie (within
    `LAYOUT_TIE` of the fastest) keeps fewer ranks. With no prediction the recipe's
    layout stays."""
    pinned = "gpus" in r.resources.learner.model_fields_set
    mine = (r.resources.learner.gpus, max(1, cores // r.resources.learner.gpus))
    told = ", ".join(f"{n} rank(s) x {t} thread(s) {s:.2f} s" for (n, t), s in seconds.items())
    if not seconds:
        why = "learner layout: none predicted (no matmul rate at its threads); the recipe's stays"
        return LayoutChoice(*mine, {}, pinned, why)
    fastest = min(seconds.values())
    best = min(
        (k for k, v in seconds.items() if v <= fastest * (1 + LAYOUT_TIE)), key=lambda k: k[0]
    )
    if pinned:
        why = f"the recipe pins resources.learner.gpus: {mine[0]}"
        if best != mine:
            why += f" (predicted faster: {best[0]} rank(s) x {best[1]} thread(s))"
        return LayoutChoice(*mine, seconds, True, f"learner layout predicted {told}; {why}")
    took = "takes the faster" if seconds[best] == fastest else "a tie, takes fewer ranks"
    return LayoutChoice(*best, seconds, False, f"learner layout predicted {told}; {took}")


def learner_layouts(
    r: Recipe,
    params: float,
    trainable: float,
    prompt_tokens: int,
    cal: CpuCalibration,
    hidden: int | None = None,
    intermediate: int | None = None,
) -> LayoutChoice:
    """`choose_learner_layout` over one rank with every core and one rank per core."""
    seconds = {}
    for ranks in sorted({1, cal.cores}):
        s = learner_seconds(r, params, trainable, prompt_tokens, cal, ranks, hidden, intermediate)
        if s is not None:
            seconds[(ranks, max(1, cal.cores // ranks))] = s
    return choose_learner_layout(r, seconds, cal.cores)
