"""`LearnerWorker`: one rank of the FSDP2 learner group (a Ray actor, one per device or
CPU process). It does not know which algorithm runs: the loss is chosen at setup
(`settings.algorithm`, see `posttrain.algorithms`) and `train_step` is one skeleton.

Verbs (10): `rendezvous`, `setup`, `compute`, `train_step`, `publish_weights`,
`join_push_group`, `save_checkpoint`, `free_reference`, `drain_spans`, `close`; plus the
session verbs of learner/sessions.py (`settings.sessions`).

Models (learner/models.py): the policy (float32 master weights, compute dtype by
FSDP2 mixed precision), optionally a frozen reference and a critic, all sharded by
one helper. With an adapter (learner/adapters.py) the policy is a peft model with
LoRA (or QLoRA: NF4 base), only the adapter is trainable, and the reference is the
policy with its adapter disabled, never a second copy; a reference with its own folder
(`settings.reference_path`: on-policy distillation's teacher) is always its own copy.

Concurrency: all ranks must call the same verbs in the same order with equally sized
shards (each verb runs collectives); the controller calls every rank at once and pads
the batch to a multiple of the world size. `publish_weights` runs after the optimizer
step, and the controller waits for it to end before the next generation
(`weightsync.push`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Literal

import torch
import torch.distributed as dist

from ..algorithms import loss_module
from ..algorithms.batch import TrainBatch
from ..common.process import quiet_libraries, set_torch_threads
from ..common.telemetry import Span, SpanRecorder
from ..weightsync import Delivery, DeltaSender, WeightHandle, make_transport, publish
from . import adapters, checkpoint
from .distributed import backend_for, cuda_memory, memory_peaks, rank_device, step_sums, where
from .logprobs import sequence_logprobs, sequence_logprobs_and_entropy
from .micro_batches import plan_rows, trim_right_padding
from .models import DTYPES, critic_values, load_models, one_gather_per_step, reward_scores
from .optimizer import guarded_step, step_stats, warn_skipped
from .push import full_state_dict, push_kind, push_source, untied_state
from .sessions import SessionVerbs
from .settings import CriticSettings, LearnerSettings
from .shm_gather import ShmGather

__all__ = ["CriticSettings", "LearnerSettings", "LearnerWorker"]

Computed = Literal["old_logprobs", "ref_logprobs", "values", "scores"]


class LearnerWorker(SessionVerbs):
    """One FSDP2 rank holding a shard of the policy, its optimizer and, when asked, a
    frozen reference and a critic; or, with `settings.sessions`, many LoRA sessions on
    one base (learner/sessions.py)."""

    def __init__(self, rank: int, world_size: int, settings: LearnerSettings, threads: int):
        set_torch_threads(threads)
        quiet_libraries()
        self.rank, self.world, self.s = rank, world_size, settings
        self.algo = loss_module(settings.algorithm)
        self.spans = SpanRecorder("learner", rank)
        self.optimizer_steps = 0
        self.transport = None
        self.delta: DeltaSender | None = None  # weight_sync.delta, rank 0 (set up in setup)
        self.gather: ShmGather | None = None  # weight_sync.shm_gather (set up in setup)
        self.critic = None
        self.device = torch.device("cpu")

    def rendezvous(self) -> dict[str, str]:
        """Where this rank runs (`node_ip`, `node_id`, `gpus`) and a group rendezvous
        `address` on its node; the controller hands rank 0's to every rank's `setup`
        (see learner/distributed.py)."""
        return where()

    def setup(self, master: int | str, resume_from: str | None = None) -> dict[str, int]:
        """Join the learner group (gloo on CPU; NCCL for CUDA tensors on `cuda`), build the
        sharded models and optimizers on this rank's device, and (rank 0, collective
        transport) join the push group. Returns the memory report of
        `adapters.memory_report` (plus `cuda_*_mb` on GPUs), equal on every rank but the
        CUDA figures. Collective: all ranks at once.

        Args:
            master: rank 0's `rendezvous()` address (`tcp://IP:PORT`), or a port on
                127.0.0.1 (one machine).
            resume_from: a folder written by `save_checkpoint(path, step, kind="state")`:
                policy, critic, optimizers, LR schedule and RNGs continue from it.

        Raises:
            ValueError: an adapter target names no linear layer of the model (raised
                before any weights load), or a QLoRA weight does not split into NF4
                blocks over the ranks.
            WeightSyncError: the push group did not form.
        """
        s = self.s
        init = master if isinstance(master, str) else f"tcp://127.0.0.1:{master}"
        self.device = rank_device(s.device)
        dist.init_process_group(
            backend_for(s.device), init_method=init, rank=self.rank, world_size=self.world
        )
        torch.manual_seed(s.seed)
        if s.sessions is not None:  # many LoRA sessions on one base (learner/sessions.py)
            report = self._setup_sessions()
            self.transport = make_transport(s.transport, rank=0 if self.rank == 0 else None)
            return report
        if s.adapter.enabled:
            adapters.check_targets(s.model_path, s.adapter.target_modules)
        kind = self.device.type
        m = load_models(s, self.world, kind)
        self.policy, self.reference, self.critic = m.policy, m.reference, m.critic
        self.optimizers, self.scheduler = m.optimizers, m.scheduler
        if resume_from is not None:
            self.optimizer_steps = checkpoint.load_state(
                self._trained(), self.scheduler, self.rank, resume_from
            )
        report = {**adapters.memory_report(self.policy, self.reference), **cuda_memory(self.device)}
        # Only rank 0 sends weights; the others never touch the push group.
        self.transport = make_transport(s.transport, rank=0 if self.rank == 0 else None)
        # weight_sync.delta: rank 0's copy of the last push; a new process starts full.
        self.delta = DeltaSender() if s.transport.delta and self.rank == 0 else None
        # weight_sync.shm_gather: CPU ranks on one machine skip gloo's all-gathers.
        if s.transport.shm_gather and kind == "cpu" and not s.adapter.enabled:
            state = untied_state(self.policy)
            self.gather = ShmGather.create(state, self.rank, self.world, DTYPES[s.compute_dtype])
        return report

    # -- forwards -------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch) -> list[tuple[torch.Tensor, TrainBatch]]:
        """`(rows, micro_batch)` pairs (see learner/micro_batches.py). Collective with a
        token budget: every rank runs as many micro-batches as the busiest one."""
        unit = getattr(self.algo, "ROWS_PER_EXAMPLE", 1)  # DPO: whole pairs
        budget = self.s.max_tokens_per_micro_batch
        plan = plan_rows(batch.attention_mask, unit, self.s.micro_batch_size, budget)
        if budget is None:
            return [(rows, batch.select(rows).to(self.device)) for rows in plan]
        count = torch.tensor([len(plan)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        plan = plan_rows(
            batch.attention_mask, unit, self.s.micro_batch_size, budget, at_least=int(count)
        )
        return [(rows, trim_right_padding(batch.select(rows)).to(self.device)) for rows in plan]

    def _logprobs(self, model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        return sequence_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.response_start,
            self.s.temperature,
            segment_ids=mb.segment_ids,
            wanted=mb.response_mask,
        )

    def _policy_output(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the loss reads of the policy: `[b, T]` logprobs, or with a scalar head
        (`head='score'`, a reward model) `[b]` scores; and from the same forward the
        `[b, T]` entropy of the policy's sampling distribution at each token (no
        gradient; None with a scalar head)."""
        if self.s.head == "score":
            return reward_scores(self.policy, mb), None
        return sequence_logprobs_and_entropy(
            self.policy,
            mb.input_ids,
            mb.attention_mask,
            mb.response_start,
            self.s.temperature,
            segment_ids=mb.segment_ids,
            wanted=mb.response_mask,
        )

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        """The frozen reference for a no-grad pass: its own copy, or with an adapter the
        policy (eval mode) with the adapter disabled.

        Raises:
            RuntimeError: there is neither (no KL term, or freed after a precompute).
        """
        if self.reference is not None:
            yield self.reference
        elif self.s.adapter.enabled:
            self.policy.eval()
            with self.policy.disable_adapter():
                yield self.policy
        else:
            raise RuntimeError(
                "reference logprobs asked for, but this run loaded no "
                "reference (kl_coef 0, or freed after the DPO precompute)"
            )

    @torch.no_grad()
    def compute(self, shard: TrainBatch, step: int, what: Computed) -> torch.Tensor:
        """A no-grad pass over this rank's shard.

        Args:
            what: 'old_logprobs' (the policy, eval mode) or 'ref_logprobs' (the frozen
                reference): `[b, T]`, 0 off the response mask; 'values' (the critic):
                `[b, T + 1]`, columns < T are V(s_t) on the response mask (0 elsewhere)
                and column T is V(s_T), the value after each row's last token.
                'scores' (a scalar-head policy, `head='score'`): `[b]`, each row's score.

        Raises:
            RuntimeError: a reference or critic this run did not load.
        """
        if what == "values":
            if self.critic is None:
                raise RuntimeError("values asked for, but this run has no critic (PPO only)")
            self.critic.eval()
            out = torch.zeros(len(shard), shard.input_ids.shape[1] + 1)
            with self.spans.span("forward", step):
                for rows, mb in self._micro_batches(shard):
                    values, final = critic_values(self.critic, mb)
                    out[rows, : values.shape[1]] = values.cpu()
                    out[rows, -1] = final.cpu()
            out[:, :-1] *= shard.response_mask
            return out
        if what == "scores":
            self.policy.eval()
            scores = torch.zeros(len(shard))
            with self.spans.span("forward", step):
                for rows, mb in self._micro_batches(shard):
                    scores[rows] = reward_scores(self.policy, mb)
            # FSDP2 leaves the root unsharded after a forward; a save's gather of the
            # adapter's parameters (learner/adapters.py) expects every one sharded.
            self.policy.reshard()
            return scores
        if what == "ref_logprobs":
            ctx = self._reference_model()
        else:
            self.policy.eval()
            ctx = nullcontext(self.policy)
        out = torch.zeros(shard.input_ids.shape)
        with ctx as model, self.spans.span("forward", step):
            for rows, mb in self._micro_batches(shard):
                logprobs = self._logprobs(model, mb)
                out[rows, : logprobs.shape[1]] = logprobs.cpu()
        return out * shard.response_mask

    def free_reference(self) -> None:
        """Drop the frozen reference (its logprobs are cached); with an adapter there is
        no copy to drop and the disabled-adapter reference stays usable."""
        self.reference = None
        gc.collect()

    # -- one optimizer step ---------------------------------------------------------------
    def train_step(self, shard: TrainBatch, step: int) -> dict[str, float]:
        """One optimizer step (policy, and critic when there is one) on this rank's
        shard with the algorithm's loss; returns step-wide metrics, equal on every rank.

        Args:
            shard: this rank's rows with what the loss reads (advantages, old/ref
                logprobs, returns, ref_sums, ...) and the step-wide `loss_denominator`.

        Returns also `entropy` (causal LMs): the mean over the step's response tokens
        (all ranks) of the entropy of softmax(logits / temperature), from the loss's own
        forward.
        """
        self.policy.train()
        if self.critic is not None:
            self.critic.train()
        sums: dict[str, float] = {}
        real = computed = 0
        loss = 0.0  # this rank's share of the step loss
        entropy = [0.0, 0.0]  # Σ entropy over response tokens, and their count
        models = [m for m, _ in self._trained().values()]
        micro_batches = self._micro_batches(shard)
        with one_gather_per_step(models, self.world) as micro_batch:
            for i, (_, mb) in enumerate(micro_batches):
                micro_batch(i == len(micro_batches) - 1)
                real += int(mb.attention_mask.sum())
                computed += mb.input_ids.numel()
                with self.spans.span("forward", step):
                    logprobs, token_entropy = self._policy_output(mb)
                    values = critic_values(self.critic, mb)[0] if self.critic is not None else None
                    out = self.algo.loss(logprobs, mb, self.s.loss, values)
                if token_entropy is not None:
                    entropy[0] += float((token_entropy * mb.response_mask).sum())
                    entropy[1] += float(mb.response_mask.sum())
                with self.spans.span("backward", step):
                    # FSDP2 averages gradients over ranks; scale so the result is the sum.
                    (out.loss * self.world).backward()
                loss += float(out.loss.detach())
                for k, v in out.sums.items():
                    sums[k] = sums.get(k, 0.0) + v
        stats = self._optimizer_step(step, loss)
        summed, shape = step_sums(sums, real, computed, entropy, self.s.head == "lm")
        return {**stats, **shape, **self.algo.finish_metrics(summed)}

    def _optimizer_step(self, step: int, loss: float) -> dict[str, float]:
        """`optimizer.guarded_step` (a NaN/inf loss or grad norm changes nothing, nor
        `optimizer_steps`; rank 0 warns) on this rank's share of the step `loss`. Returns
        grad_norm (the policy's, before clipping), lr, `skipped_updates` (1: not applied)
        and `learner_peak_rss_mb` (this rank's peak resident MiB; on GPUs also
        `learner_cuda_peak_mb`, the most CUDA memory its tensors held). Collective."""
        models = [m for m, _ in self._trained().values()]
        with self.spans.span("optimizer", step):
            done = guarded_step(models, self.optimizers, self.scheduler, self.s.max_grad_norm, loss)
            if done.applied:
                self.optimizer_steps += 1
            elif self.rank == 0:
                warn_skipped(step, done)
            time.sleep(self.s.delay_s)
        return {**step_stats(done), **memory_peaks(self.device)}

    # -- weights out ----------------------------------------------------------------------
    def publish_weights(
        self, version: int, full: bool = False, fresh: bool = False
    ) -> Iterator[WeightHandle | Delivery | None]:
        """Publish the policy as `version` through the transport (a generator: the handle
        first, rank 0 only, then, with verification, the fingerprints it sent once
        delivered; see `weightsync.publish`). With `transport.adapter_only` only the
        adapter goes, unless `full` (QLoRA sends its dequantised base once, as version
        0). With `transport.delta` only changed elements go, unless `fresh` (engines
        were replaced) or this is the learner's first push. Collective."""
        s = self.s
        if fresh and self.delta is not None:
            self.delta.reset()
        with self.spans.span("weight_sync", version - 1):
            source = push_source(
                self.policy,
                self.rank,
                s.model_path,
                s.adapter,
                DTYPES[s.compute_dtype],
                push_kind(s.transport.adapter_only, full),
                self.gather,
            )
            yield from publish(
                self.transport,
                source,
                version,
                sender=self.rank == 0,
                verify=s.transport.checksum,
                delta=self.delta,
            )

    def join_push_group(self, address: str, world_size: int) -> None:
        """Rank 0 only: leave the weight broadcast group and join a new one at `address`
        as its rank 0 (with every engine at once; the controller re-forms the group after
        it replaced an engine or the learner group).

        Raises:
            WeightSyncError: the group did not form within the transport's timeout.
        """
        if self.transport is not None:
            self.transport.close()
        settings = replace(self.s.transport, group_address=address, group_world=world_size)
        self.transport = make_transport(settings, rank=0)

    def save_checkpoint(
        self, path: str, step: int, kind: Literal["policy", "state"] = "policy"
    ) -> str | None:
        """Save into `path` (see learner/checkpoint.py). Collective; returns the path on
        rank 0.

        Args:
            kind: 'policy': the policy alone (`save_pretrained` format, or the adapter in
                PEFT format; rank 0 writes). 'state': everything a step changes (policy,
                critic and their optimizers sharded by DCP, LR schedule, step count, each
                rank's RNGs), which `setup(resume_from=path)` loads.
        """
        with self.spans.span("checkpoint", step):
            if kind == "state":
                checkpoint.save_state(
                    self._trained(), self.scheduler, self.optimizer_steps, self.rank, path
                )
                return path if self.rank == 0 else None
            return checkpoint.save_policy(
                self.policy, self.rank, self.s.model_path, self.s.adapter, path, self.s.head
            )

    def _trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Each trained model with its optimizer (the policy; the critic for PPO)."""
        out = {"policy": (self.policy, self.optimizers[0])}
        if self.critic is not None:
            out["critic"] = (self.critic, self.optimizers[1])
        return out

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (merged) policy, float32, complete on rank 0 (tests read it)."""
        return full_state_dict(
            self.policy, self.rank, self.s.model_path, self.s.adapter, self.s.head
        )

    def drain_spans(self) -> list[Span]:
        """This rank's busy spans since the last call."""
        return self.spans.drain()

    def close(self) -> None:
        """Release the weight transport's buffers, files and group, and leave the
        learner group."""
        if self.transport is not None:
            self.transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()
