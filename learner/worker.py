"""`LearnerWorker`: one rank of the FSDP2 learner group (a Ray actor, one per device or
CPU process).

Structure: every decoder layer and then the root module are wrapped with
`fully_shard`; parameters are stored (and AdamW runs) in float32 and cast to
`compute_dtype` for forward/backward by FSDP2's `MixedPrecisionPolicy`, with gradients
reduced in float32. Storing bf16 weights instead makes small updates vanish: at lr
1e-6 most of an AdamW step is below bf16's spacing.

Concurrency: all ranks must call the same verbs in the same order with equally sized
shards (each verb runs collectives); the controller guarantees this by calling every
rank at once and padding the batch to a multiple of the world size. `push_weights` is
called after the optimizer step and its handle is awaited by the controller before
the next generation.

Adapters (`settings.adapter`, see learner/adapters.py): the policy is a peft model
with LoRA (or QLoRA: NF4 base) put on before `fully_shard`; only the adapter is
trainable and in AdamW, the frozen base is stored in the compute dtype (or NF4), and
the reference is the policy with its adapter disabled, never a second copy.
`push_weights` then publishes merged full weights under the plain transformers names,
`adapter_state` the adapter alone, and `save_checkpoint` writes the adapter in PEFT
format (plus, with `save_merged`, the merged model).

Verbs: `setup`, `compute_logprobs`, `train_step`, `push_weights`, `adapter_state`,
`save_checkpoint`, `drain_spans`.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.common.net import free_port
from posttrain.common.process import quiet_libraries, set_torch_threads
from posttrain.common.telemetry import Span, SpanRecorder
from posttrain.learner import adapters
from posttrain.learner.adapters import AdapterSettings
from posttrain.learner.batch import TrainBatch
from posttrain.learner.dpo_verbs import DPOVerbs
from posttrain.learner.logprobs import sequence_logprobs
from posttrain.algorithms.common import aggregate_loss, clipped_policy_loss
from posttrain.learner.ppo_verbs import PPOVerbs
from posttrain.weightsync import TransportSettings, WeightHandle, make_transport

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LearnerSettings:
    """Plain values a learner rank needs; built by the controller from the recipe."""

    model_path: str
    compute_dtype: str = "bfloat16"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    seed: int = 0
    transport: TransportSettings = TransportSettings()
    delay_s: float = 0.0  # test knob: extra busy seconds per train_step
    load_reference: bool = False  # a frozen reference (GRPO with KL, or DPO)
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    dpo_loss_type: str = "sigmoid"
    critic: bool = False  # PPO: load a critic next to the policy
    critic_path: str | None = None
    critic_lr: float = 1e-5
    cliprange_value: float = 0.2
    adapter: AdapterSettings = field(default_factory=AdapterSettings)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (plain tensors) without the later names of tensors that share storage."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


class LearnerWorker(DPOVerbs, PPOVerbs):
    """One FSDP2 rank holding the policy shard, its optimizer and, for KL or DPO, a
    frozen reference shard."""

    def __init__(self, rank: int, world_size: int, settings: LearnerSettings, threads: int):
        set_torch_threads(threads)
        quiet_libraries()
        self.rank, self.world, self.s = rank, world_size, settings
        self.spans = SpanRecorder("learner", rank)
        self.transport = make_transport(settings.transport)
        self.optimizer_steps = 0

    # -- set-up -------------------------------------------------------------------------
    def setup(self, master_port: int) -> dict[str, int]:
        """Join the gloo group and build the sharded policy (and reference). Returns the
        memory report of `adapters.memory_report` (trainable parameters, frozen bytes
        actual and at bf16, optimizer bytes), equal on every rank. Collective: call on
        all ranks at once.

        Raises:
            ValueError: an adapter target names no linear layer of the model (raised
                before any weights load), or a QLoRA weight does not split into NF4
                blocks over the ranks.
        """
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{master_port}",
            rank=self.rank,
            world_size=self.world,
        )
        torch.manual_seed(self.s.seed)
        if self.s.adapter.enabled:
            adapters.check_targets(self.s.model_path, self.s.adapter.target_modules)
        self.policy = self._load_sharded(trainable=True)
        # With an adapter the reference is the policy with the adapter disabled.
        load_ref = self.s.load_reference and not self.s.adapter.enabled
        self.reference = self._load_sharded(trainable=False) if load_ref else None
        self.critic = None
        if self.s.critic:
            self._setup_critic()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=self.s.lr,
            betas=self.s.betas,
            weight_decay=self.s.weight_decay,
        )
        warm = self.s.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0
        )
        return adapters.memory_report(self.policy, self.reference)

    def _dtype(self) -> torch.dtype:
        return _DTYPES[self.s.compute_dtype]

    def _load_sharded(self, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.s.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if trainable and self.s.adapter.enabled:
            model = adapters.wrap_policy(model, self.s.adapter, self.world, self._dtype())
        mp = MixedPrecisionPolicy(
            param_dtype=self._dtype(), reduce_dtype=torch.float32
        )
        ignored = adapters.fsdp_ignored_params(model, self.world)
        for layer in adapters.decoder_layers(model):
            fully_shard(layer, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mp_policy=mp, ignored_params=ignored)
        if trainable and self.s.adapter.enabled:
            # FSDP2 fixes each group's reduce dtype from the parameters that require grad
            # at its first forward, and peft's disable_adapter() clears requires_grad: a
            # reference pass first would leave bf16 gradients that fail to reduce into
            # float32 ones. One tiny forward now, adapter on, settles it.
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 1, dtype=torch.long))
            model.reshard()  # the root stays unsharded after a forward
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return model

    # -- verbs --------------------------------------------------------------------------
    def _logprobs(self, model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        return sequence_logprobs(
            model, mb.input_ids, mb.attention_mask, mb.response_start, self.s.temperature
        )

    @contextmanager
    def _reference_model(self, missing: str) -> Iterator[torch.nn.Module]:
        """The frozen reference for a no-grad pass: its own copy, or with an adapter the
        policy (in eval mode) with the adapter disabled.

        Raises:
            RuntimeError: `missing`, when there is neither.
        """
        if self.reference is not None:
            yield self.reference
        elif self.s.adapter.enabled:
            self.policy.eval()
            with self.policy.disable_adapter():
                yield self.policy
        else:
            raise RuntimeError(missing)

    def _eval_policy(self) -> nullcontext[torch.nn.Module]:
        """The policy in eval mode (no adapter dropout) for a no-grad pass."""
        self.policy.eval()
        return nullcontext(self.policy)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        n = self.s.micro_batch_size
        return [batch.select(slice(i, i + n)) for i in range(0, len(batch), n)]

    @torch.no_grad()
    def compute_logprobs(
        self, shard: TrainBatch, step: int, reference: bool = False
    ) -> torch.Tensor:
        """`[b, T]` logprobs of this rank's shard under the policy (`old_logprobs`) or the
        frozen reference (`ref_logprobs`).

        Raises:
            RuntimeError: `reference=True` but the recipe has no KL term.
        """
        missing = "reference logprobs asked for, but grpo.kl_coef is 0"
        ctx = self._reference_model(missing) if reference else self._eval_policy()
        with ctx as model, self.spans.span("forward", step):
            parts = [self._logprobs(model, mb) for mb in self._micro_batches(shard)]
        return torch.cat(parts) * shard.response_mask

    def train_step(self, shard: TrainBatch, denominator: float, step: int) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns step-wide metrics (identical on
        every rank).

        Args:
            shard: rows of this rank, with old_logprobs, advantages (and ref_logprobs).
            denominator: `loss_denominator` of the whole step, over all ranks.
        """
        self.policy.train()
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, kl, tokens
        for mb in self._micro_batches(shard):
            with self.spans.span("forward", step):
                logprobs = self._logprobs(self.policy, mb)
                terms = clipped_policy_loss(
                    logprobs,
                    mb.old_logprobs,
                    mb.advantages,
                    self.s.clip_low,
                    self.s.clip_high,
                    ref_logprobs=mb.ref_logprobs,
                    kl_coef=self.s.kl_coef,
                )
                loss = aggregate_loss(terms.loss, mb.response_mask, denominator)
            with self.spans.span("backward", step):
                # FSDP2 averages gradients over ranks; scale so the result is the sum.
                (loss * self.world).backward()
            m = mb.response_mask
            sums += torch.tensor(
                [loss.item(), (terms.clipped * m).sum().item(), (terms.kl * m).sum().item(),
                 m.sum().item()], dtype=torch.float64,
            )
        stats = self._optimizer_step(step)
        dist.all_reduce(sums)
        tokens = max(sums[3].item(), 1.0)
        return {
            **stats,
            "loss": sums[0].item(),
            "clip_fraction": sums[1].item() / tokens,
            "kl": sums[2].item() / tokens,
        }

    def _optimizer_step(self, step: int) -> dict[str, float]:
        """Clip, step AdamW and the LR schedule; returns grad_norm (before clipping), lr,
        and this rank's peak resident memory so far (`learner_peak_rss_mb`, MiB)."""
        with self.spans.span("optimizer", step):
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.policy.parameters(), self.s.max_grad_norm
            )
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_steps += 1
            time.sleep(self.s.delay_s)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        return {"grad_norm": float(grad_norm), "lr": lr, "learner_peak_rss_mb": peak_mb}

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy under plain transformers names, float32 on CPU; with an
        adapter, merged into the (dequantised) base. Collective; complete on rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.s.adapter.enabled:
            full = adapters.gather_params(self.policy, adapter_only=False, keep=self.rank == 0)
            if self.rank != 0:
                return {}
            return adapters.merged_state_dict(full, self.s.model_path, self.s.adapter)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.policy, options=opts)

    @torch.no_grad()
    def _push_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full policy cast to the engines' `dtype`, plain transformers names, on
        rank 0. Without an adapter each shard is cast *before* the all-gather, so a
        bf16 push gathers half the bytes of `_full_state_dict`; tied names share one
        gathered tensor. Collective; complete on rank 0, empty elsewhere."""
        if self.s.adapter.enabled:
            full = _untied(self._full_state_dict())
            return {k: v.to(dtype) for k, v in full.items()}
        return dict(self._iter_push_state(dtype))

    def _iter_push_state(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, full tensor in dtype)` in state-dict order, gathered one parameter at a
        time. A tied alias (`lm_head.weight` of a tied-embedding model) is not sent: the
        engines tie it themselves. Collective: every rank iterates it to the end."""
        for name, t in self._untied_state().items():
            local = t.detach().to(dtype)
            yield name, local.full_tensor() if hasattr(local, "full_tensor") else local

    def weight_layout(self, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """`(name, dtype, global shape)` of every tensor a full push sends, in order; no
        communication (so a streamed push's handle can be made before gathering)."""
        d = str(_DTYPES[dtype]).removeprefix("torch.")
        return [(n, d, tuple(t.shape)) for n, t in self._untied_state().items()]

    def _untied_state(self) -> dict[str, torch.Tensor]:
        """The policy's state dict without tied aliases; the same names on every rank
        (`named_parameters` drops a shared Parameter's later names)."""
        keep = {n for n, _ in self.policy.named_parameters()}
        keep |= {n for n, _ in self.policy.named_buffers()}
        return {n: t for n, t in self.policy.state_dict().items() if n in keep}

    def adapter_state(self, dtype: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The adapter alone, for adapter-only weight sync: `(tensors, lora_config)` with
        the tensors as `peft.get_peft_model_state_dict` names them (e.g.
        `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, `[r, in]`),
        cast to `dtype`, and the `peft.LoraConfig` as a plain dict. Collective; rank 0
        returns it, the others None.

        Raises:
            RuntimeError: the recipe has no adapter (model.adapter.type: none).
        """
        if not self.s.adapter.enabled:
            raise RuntimeError("adapter_state needs model.adapter.type lora or qlora")
        full = adapters.gather_params(self.policy, adapter_only=True, keep=self.rank == 0)
        if self.rank != 0:
            return None
        state = adapters.peft_adapter_state(self.policy, full)
        return ({k: v.to(_DTYPES[dtype]) for k, v in state.items()},
                adapters.config_dict(self.policy))

    def push_weights(self, version: int, dtype: str, checksum: bool = False,
                     adapter_only: bool = False,
                     stream: WeightHandle | None = None) -> WeightHandle | None:
        """Gather the full policy (with an adapter: merged, see `_full_state_dict`) and
        publish it as `version` through the transport. With `adapter_only`, publish only
        the adapter tensors (PEFT names) and put its LoraConfig in
        `handle.meta["adapter_config"]`. With `stream` (collective transport, a handle
        from `weight_layout`), broadcast each bucket as soon as its tensors are gathered
        while the engines receive, and return only when all is delivered. Collective;
        rank 0 returns the handle, the others None."""
        with self.spans.span("weight_sync", version - 1):
            if stream is not None:
                if self.s.adapter.enabled:
                    raise RuntimeError("a streamed push needs the plain policy; with an "
                                       "adapter, push merged weights or the adapter")
                tensors = self._iter_push_state(_DTYPES[dtype])
                if self.rank == 0:
                    self.transport.send_stream(tensors, stream)
                else:
                    for _ in tensors:  # the all-gathers need every rank
                        pass
                return stream if self.rank == 0 else None
            if adapter_only:
                state = self.adapter_state(dtype)
                if state is None:
                    return None
                handle = self.transport.send(state[0], version, checksum=checksum)
                return dataclasses.replace(handle, meta={**handle.meta,
                                                         "adapter_config": state[1]})
            cast = self._push_state_dict(_DTYPES[dtype])
            if self.rank != 0:
                return None
            return self.transport.send(cast, version, checksum=checksum)

    def weight_group_address(self) -> str:
        """`host:port` where rank 0 will host the broadcast group's rendezvous store."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def join_weight_group(self, address: str, world_size: int) -> int:
        """Rank 0 joins the broadcast group with every rollout engine as its rank 0
        (collective transport only; the engines call `join_weight_group` at once).
        Other ranks do nothing. Returns this rank."""
        if self.rank == 0:
            self.transport.join_group(address, 0, world_size)
        return self.rank

    def finish_push(self, handle: WeightHandle | None) -> None:
        """Wait until the push of `handle` is delivered (rank 0; a no-op for transports
        that finish inside `send`).

        Raises:
            WeightSyncError: the delivery failed or timed out.
        """
        if self.rank == 0 and handle is not None:
            self.transport.finish(handle)

    def save_checkpoint(self, path: str, step: int) -> str | None:
        """Save the full policy with `save_pretrained` (plus tokenizer) into `path`.
        With an adapter: the adapter in PEFT format (`adapter_config.json`,
        `adapter_model.safetensors`; `PeftModel.from_pretrained(base, path)` loads it),
        and with `adapter.save_merged` also the merged model in `path/merged`.
        Collective; rank 0 writes and returns the path."""
        from transformers import AutoTokenizer

        with self.spans.span("checkpoint", step):
            if self.s.adapter.enabled:
                self._save_adapter(Path(path))
                merged = Path(path) / "merged" if self.s.adapter.save_merged else None
            else:
                merged = Path(path)
            if merged is not None:
                self._save_full(merged)
            if self.rank != 0:
                return None
            AutoTokenizer.from_pretrained(self.s.model_path).save_pretrained(path)
            return path

    def _save_full(self, path: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        full = self._full_state_dict()
        if self.rank != 0:
            return
        config = AutoConfig.from_pretrained(self.s.model_path)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(full, assign=True, strict=False)
        plain.tie_weights()
        path.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(path)

    def _save_adapter(self, path: Path) -> None:
        from safetensors.torch import save_file

        full = adapters.gather_params(self.policy, adapter_only=True, keep=self.rank == 0)
        if self.rank != 0:
            return
        state = adapters.peft_adapter_state(self.policy, full)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapters.lora_config(self.s.adapter, self.s.model_path)
        config.save_pretrained(str(path))

    def drain_spans(self) -> list[Span]:
        return self.spans.drain()

    def close_transport(self) -> None:
        """Release the weight transport's buffers, files and group."""
        self.transport.close()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
