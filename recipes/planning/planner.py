"""`posttrain plan`'s model of one recipe on one kind of GPU: memory per device, step
time and the rollout:learner split, from recipes/planning/formulas.py's formulas.

Structure: `ModelShape` (recipes/planning/shape.py) reads a Llama-style config.json;
`plan_recipe` returns a `RecipePlan` of plain numbers and flags; the CLI prints it.
Nothing here imports torch.

The step model is synchronous on-policy, as `posttrain run` is: decode, then train, then
push weights, one after the other. Rollout idles while the learner trains, the learner
while engines decode; both take part in the push. Every response is counted at
rollout.max_new_tokens (an upper bound: samples that stop early cost less).
Not modelled: prefill, scoring, the old-logprob pass, CUDA/NCCL overheads.

Nodes (`Cluster`): devices are placed rollout engines first, then learner ranks, packed
node by node (Ray's PACK placement); an engine's tensor-parallel group never spans two
nodes. The weight push goes from learner rank 0 to every engine: over NVLink when they
all sit on one node, else over the inter-node NIC (the hardware table's two links).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...common.packing import packing_pays
from ...config import Recipe
from . import formulas as plan
from .formulas import GB, Hardware
from .shape import ModelShape


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `gpus_per_node` devices each (`posttrain plan --nodes N
    --gpus-per-node G`)."""

    nodes: int
    gpus_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def push_crosses_nodes(self, rollout: int) -> bool:
        """Whether learner rank 0 (device index `rollout`, after the engines) and some
        engine (devices 0..rollout-1) sit on different nodes."""
        return rollout > 0 and rollout // self.gpus_per_node > 0


DEFAULT_NODE = 8  # devices per node when no cluster is given (an HGX/DGX board)


@dataclass
class Times:
    """Seconds of one step with `rollout` engine devices and `learner` ranks."""

    rollout: int
    learner: int
    decode: float
    train: float
    push: float
    cross_node: bool = False  # the push crosses nodes (NIC), else NVLink

    @property
    def step(self) -> float:
        return self.decode + self.train + self.push


@dataclass
class RecipePlan:
    """What `posttrain plan` prints; memory in bytes, times in seconds."""

    gpu: str
    hw: Hardware
    mfu: float
    prompt_tokens: int
    response_tokens: int
    sequences: int
    learner_memory: dict[str, float]
    engine_memory: dict[str, float]
    times: Times
    best: Times | None
    flags: list[str] = field(default_factory=list)
    cluster: Cluster | None = None

    @property
    def learner_total(self) -> float:
        return sum(v for k, v in self.learner_memory.items() if "checkpointed" not in k)

    @property
    def engine_total(self) -> float:
        return sum(self.engine_memory.values())


def _learner_memory(r: Recipe, m: ModelShape, ranks: int, seq: int) -> dict[str, float]:
    a = r.model.adapter
    out: dict[str, float] = {}
    if a.type == "none":
        out["weights+grads+AdamW (16 B/param, FSDP)"] = plan.zero_bytes_per_rank(m.params, ranks, 3)
    else:
        quant = "nf4" if a.type == "qlora" else "bf16"
        out[f"frozen base ({quant})"] = plan.frozen_base_bytes(m.params, quant) / ranks
        out[f"{a.type} adapter (16 B/param)"] = (
            plan.training_state_bytes(m.lora_params(a.r, a.target_modules)) / ranks
        )
    facts = r.facts
    if facts.reference and a.type == "none":  # with an adapter the base is the reference
        out["reference (bf16)"] = plan.frozen_base_bytes(m.params) / ranks
    if facts.critic:
        out["critic (16 B/param, FSDP)"] = plan.zero_bytes_per_rank(m.params, ranks, 3)
    for ckpt in (False, True):
        key = "activations" + (" (checkpointed: not counted)" if ckpt else "")
        out[key] = plan.activation_bytes(
            m.layers, seq, r.train.micro_batch_size, m.hidden, m.heads, m.vocab, checkpointing=ckpt
        )
    return out


def weight_bytes(r: Recipe) -> int:
    """Bytes per parameter of the engine's weights and of a push: `model.dtype`'s width
    (the learner computes in it and the engines serve it)."""
    return 4 if r.model.dtype == "float32" else 2


def _reply_tokens(r: Recipe) -> int:
    """Most tokens after the prompt: a pair's max length, or the rollout's new tokens."""
    if not r.facts.uses_rollouts:
        return getattr(r, r.algorithm).max_length
    return r.rollout.max_new_tokens


def step_flops(r: Recipe, params: float, policy_tokens: float, critic_tokens: float) -> float:
    """Training FLOPs of one step, from the passes the algorithm's step makes
    (`r.facts.passes`, config/facts.py): a forward costs 2·N per token and a forward +
    backward 6·N, or 4·N with an adapter (no weight gradients) (Kaplan et al. 2020).
    The policy and the reference run over `policy_tokens` (packed groups), the critic,
    which does not pack, over `critic_tokens`."""
    p = r.facts.passes
    train = (4 if r.model.adapter.type != "none" else 6) * params
    forward = 2 * params
    policy = train * p.policy_train + forward * (p.policy_forward + p.reference_forward)
    critic = 6 * params * p.critic_train + forward * p.critic_forward
    return policy * policy_tokens + critic * critic_tokens


def trained_tokens(
    r: Recipe, prompt_tokens: int, hidden: int | None, intermediate: int | None
) -> float:
    """Tokens the learner computes per forward pass of one GRPO/PPO step, over all ranks.

    learner/logprobs.py packs the rows of one prompt that share a micro-batch into one
    sequence (`[prompt | response 1 | ... ]`) when that cuts the forward's FLOPs by
    ≥ 10% (`common.packing.packing_pays`, from the model's `hidden`/`intermediate`
    sizes; None: never packed). Then a group of G samples costs its prompt once per
    micro-batch it spans (ceil(G / micro_batch_size) times) plus G responses, instead
    of G · (prompt + response). Every response counts at `rollout.max_new_tokens`.
    """
    g, mb = r.rollout.samples_per_prompt, r.train.micro_batch_size
    prompts = r.train.prompts_per_step
    seq = prompt_tokens + r.rollout.max_new_tokens
    per_mb = max(1, mb // g)  # prompts in one micro-batch
    if (
        hidden is None
        or g < 2
        or mb < 2
        or not packing_pays(
            min(mb, per_mb * g),
            seq,
            prompt_tokens,
            per_mb,
            min(g, mb),
            hidden,
            intermediate or 4 * hidden,
        )
    ):
        return prompts * g * seq
    return prompts * (-(-g // mb) * prompt_tokens + g * r.rollout.max_new_tokens)


def _times(
    r: Recipe,
    m: ModelShape,
    hw: Hardware,
    mfu: float,
    rollout: int,
    learner: int,
    prompt: int,
    sequences: int,
    cluster: Cluster,
) -> Times:
    seq = prompt + _reply_tokens(r)
    tokens = sequences * seq
    # the policy and the reference pack a group's shared prompt; the critic does not
    pairs = not r.facts.uses_rollouts
    packed = tokens if pairs else trained_tokens(r, prompt, m.hidden, m.intermediate)
    a = r.model.adapter
    flops = step_flops(r, m.params, packed, tokens)
    train = plan.compute_seconds(flops, learner, hw.bf16_flops, mfu)
    if pairs:
        return Times(0, learner, 0.0, train, 0.0)
    engines = rollout // r.resources.rollout.gpus_per_engine
    per_engine = -(-sequences // engines)
    decode = plan.decode_seconds(
        plan.broadcast_bytes(m.params, weight_bytes(r)),
        m.kv_bytes_per_token(),
        per_engine,
        prompt,
        r.rollout.max_new_tokens,
        hw.hbm_bytes_per_s * r.resources.rollout.gpus_per_engine,
    )
    pushed = (
        m.lora_params(a.r, a.target_modules)
        if (r.weight_sync.adapter_mode == "adapter")
        else m.params
    )
    cross = cluster.push_crosses_nodes(rollout)
    link = hw.network_bytes_per_s if cross else hw.nvlink_one_way_bytes_per_s
    push = plan.transfer_seconds(plan.broadcast_bytes(pushed, weight_bytes(r)), link)
    return Times(rollout, learner, decode, train, push, cross)


def plan_recipe(
    r: Recipe,
    m: ModelShape,
    gpu: str,
    prompt_tokens: int,
    mfu: float = 0.4,
    cluster: Cluster | None = None,
    hw: Hardware | None = None,
) -> RecipePlan:
    """Memory, step time and best split of recipe `r` for model `m` on `gpu`.

    Args:
        prompt_tokens: the longest prompt after the chat template, tokens.
        mfu: the assumed model-FLOPs utilisation of training (shown on screen).
        cluster: the machines to plan for; the split search uses all their devices.
            Default: the recipe's devices, packed on nodes of 8.
        hw: the device's numbers; default `plan.HARDWARE[gpu]`.
    """
    hw = hw or plan.HARDWARE[gpu]
    res = r.resources
    asked = res.rollout.gpus + res.learner.gpus
    node = Cluster(-(-asked // DEFAULT_NODE), DEFAULT_NODE)
    cluster_given = cluster is not None
    cluster = cluster or node
    dpo = not r.facts.uses_rollouts  # pairs: no rollout side
    sequences = r.train.prompts_per_step * (2 if dpo else r.rollout.samples_per_prompt)
    seq = prompt_tokens + _reply_tokens(r)
    rollout = 0 if dpo else res.rollout.gpus
    learner = _learner_memory(r, m, res.learner.gpus, seq)
    engine = {} if dpo else _engine_memory(r, m, sequences, seq)
    now = _times(r, m, hw, mfu, rollout, res.learner.gpus, prompt_tokens, sequences, cluster)
    p = RecipePlan(
        gpu,
        hw,
        mfu,
        prompt_tokens,
        seq - prompt_tokens,
        sequences,
        learner,
        engine,
        now,
        None,
        cluster=cluster if cluster_given else None,
    )
    p.best = _best_split(r, m, hw, mfu, prompt_tokens, sequences, cluster, cluster_given)
    p.flags = _flags(r, p) + _cluster_flags(r, cluster if cluster_given else None)
    return p


def _engine_memory(r: Recipe, m: ModelShape, sequences: int, seq: int) -> dict[str, float]:
    """Bytes per rollout device, by what holds them: the engine's weights and the KV
    cache of its share of the step's `sequences`, each `seq` tokens long (tensor
    parallel divides both over an engine's devices)."""
    res = r.resources
    engines = res.rollout.engines
    per_engine = -(-sequences // engines)
    engine: dict[str, float] = {}
    engine[f"weights ({r.model.dtype})"] = (
        plan.broadcast_bytes(m.params, weight_bytes(r)) / res.rollout.gpus_per_engine
    )
    engine[f"KV cache ({per_engine} seqs x {seq} tokens)"] = (
        plan.kv_cache_bytes(m.layers, m.kv_heads, m.head_dim, per_engine * seq)
        / res.rollout.gpus_per_engine
    )
    return engine


def _cluster_flags(r: Recipe, cluster: Cluster | None) -> list[str]:
    """A recipe asking for more devices than the cluster has, or engines that would
    span nodes."""
    if cluster is None:
        return []
    res, out = r.resources, []
    asked = (res.rollout.gpus if r.facts.uses_rollouts else 0) + res.learner.gpus
    if res.colocate:
        asked = max(res.rollout.gpus, res.learner.gpus)
    if asked > cluster.devices:
        out.append(
            f"resources: the recipe asks for {asked} devices, --nodes {cluster.nodes} "
            f"x --gpus-per-node {cluster.gpus_per_node} has {cluster.devices}; lower "
            "resources.rollout.gpus / resources.learner.gpus or add nodes"
        )
    per_engine = res.rollout.gpus_per_engine
    if r.facts.uses_rollouts and cluster.gpus_per_node % per_engine:
        out.append(
            f"resources.rollout.gpus_per_engine: {per_engine} does not divide "
            f"--gpus-per-node {cluster.gpus_per_node}: an engine's tensor-parallel "
            "group would span two nodes; choose a divisor of the node's devices"
        )
    return out


def _best_split(
    r: Recipe,
    m: ModelShape,
    hw: Hardware,
    mfu: float,
    prompt: int,
    sequences: int,
    cluster: Cluster,
    given: bool,
) -> Times | None:
    """The rollout:learner split of the cluster's devices with the shortest step whose
    learner state fits (None when nothing can move: DPO, colocated devices, or engines
    that cannot be placed within the `given` cluster's nodes)."""
    res = r.resources
    per_engine = res.rollout.gpus_per_engine
    split_engines = given and cluster.gpus_per_node % per_engine
    if not r.facts.uses_rollouts or res.colocate or split_engines:
        return None
    total = cluster.devices if given else res.rollout.gpus + res.learner.gpus
    seq = prompt + r.rollout.max_new_tokens
    best = None
    for rollout in range(per_engine, total, per_engine):
        mem = _learner_memory(r, m, total - rollout, seq)
        if sum(v for k, v in mem.items() if "checkpointed" not in k) > hw.hbm_bytes:
            continue
        t = _times(r, m, hw, mfu, rollout, total - rollout, prompt, sequences, cluster)
        if best is None or t.step < best.step:
            best = t
    return best


def _flags(r: Recipe, p: RecipePlan) -> list[str]:
    """What does not fit, each naming the key to change."""
    out = []
    hbm = p.hw.hbm_bytes
    if p.learner_total > hbm:
        out.append(
            f"learner: {p.learner_total / GB:.1f} GB per device > {hbm / GB:.0f} GB; "
            "raise resources.learner.gpus, lower train.micro_batch_size, or set "
            "model.adapter.type: lora / qlora"
        )
    if p.engine_total > hbm:
        out.append(
            f"rollout engine: {p.engine_total / GB:.1f} GB > {hbm / GB:.0f} GB; raise "
            "resources.rollout.gpus or lower rollout.max_new_tokens / "
            "train.prompts_per_step"
        )
    if r.resources.colocate and p.learner_total + p.engine_total > hbm:
        out.append(
            f"colocated: learner + engine {(p.learner_total + p.engine_total) / GB:.1f}"
            f" GB per device > {hbm / GB:.0f} GB; set resources.colocate: false"
        )
    kv = next((v for k, v in p.engine_memory.items() if k.startswith("KV")), 0.0)
    budget = r.rollout.vllm.kv_cache_gb * 2**30
    if r.rollout.engine == "vllm" and kv > budget:
        out.append(
            f"rollout.vllm.kv_cache_gb: the step's KV cache needs {kv / 2**30:.2f} GiB "
            f"per engine, {r.rollout.vllm.kv_cache_gb:g} GiB is reserved: sequences "
            f"wait for room; set rollout.vllm.kv_cache_gb: {kv / 2**30 * 1.1:.2f}"
        )
    return out
