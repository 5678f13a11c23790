"""DPO verbs of `LearnerWorker` (a mixin; same FSDP2 group, same collectives contract).

Rows come in pairs: row 2i is pair i's chosen reply, row 2i+1 its rejected reply, so
a shard or micro-batch with an even number of rows never splits a pair.

With an adapter the reference (precompute included) is the policy with its adapter
disabled; `free_reference` then frees nothing, as there is no copy.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from posttrain.learner.batch import TrainBatch
from posttrain.algorithms.dpo import dpo_loss


class DPOVerbs:
    """Mixed into LearnerWorker; uses its policy, reference, optimizer and spans."""

    def _sums(self, model: torch.nn.Module, shard: TrainBatch, step: int) -> torch.Tensor:
        with self.spans.span("forward", step):
            parts = [(self._logprobs(model, mb) * mb.response_mask).sum(-1)
                     for mb in self._micro_batches(shard)]
        return torch.cat(parts)

    @torch.no_grad()
    def sequence_logprob_sums(self, shard: TrainBatch, step: int,
                              reference: bool = True) -> torch.Tensor:
        """`[rows]` summed response logprobs under the reference (or the policy).

        Raises:
            RuntimeError: the reference was freed (after a precompute) or never loaded.
        """
        missing = "no reference model on this learner (freed after precompute?)"
        ctx = self._reference_model(missing) if reference else self._eval_policy()
        with ctx as model:
            return self._sums(model, shard, step)

    def free_reference(self) -> None:
        """Drop the frozen reference (after its logprobs are cached); with an adapter
        there is no copy to drop and the disabled-adapter reference stays usable."""
        self.reference = None
        gc.collect()

    def dpo_train_step(self, shard: TrainBatch, ref_sums: torch.Tensor, pairs_in_step: int,
                       step: int) -> dict[str, float]:
        """One optimizer step on this rank's pairs; metrics are step-wide on every rank.

        Args:
            shard: `[2p, T]` rows, chosen/rejected interleaved.
            ref_sums: `[2p]` reference summed logprobs of the same rows.
            pairs_in_step: real pairs over all ranks (the loss is their mean); padding
                pairs have all-zero response masks.
        """
        s = self.s
        self.policy.train()
        sums = torch.zeros(5, dtype=torch.float64)  # loss, acc, chosen r, rejected r, pairs
        n = s.micro_batch_size + s.micro_batch_size % 2  # whole pairs per micro-batch
        for i in range(0, len(shard), n):
            mb = shard.select(slice(i, i + n))
            with self.spans.span("forward", step):
                pol = (self._logprobs(self.policy, mb) * mb.response_mask).sum(-1)
                ref = ref_sums[i:i + n]
                t = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], s.dpo_beta,
                             s.dpo_label_smoothing, s.dpo_loss_type)
                # padding pairs (all-zero masks) keep the ranks in step but count nowhere
                valid = (mb.response_mask[0::2].sum(-1) > 0).float()
                loss = (t.loss * valid).sum() / pairs_in_step
            with self.spans.span("backward", step):
                (loss * self.world).backward()  # FSDP2 averages over ranks
            won = (t.chosen_rewards > t.rejected_rewards).float()
            sums += torch.tensor([loss.item(), (won * valid).sum().item(),
                                  (t.chosen_rewards * valid).sum().item(),
                                  (t.rejected_rewards * valid).sum().item(), valid.sum().item()],
                                 dtype=torch.float64)
        stats = self._optimizer_step(step)
        dist.all_reduce(sums)
        pairs = max(sums[4].item(), 1.0)
        return {**stats, "loss": sums[0].item(), "rewards/accuracy": sums[1].item() / pairs,
                "rewards/chosen": sums[2].item() / pairs,
                "rewards/rejected": sums[3].item() / pairs,
                "rewards/margin": (sums[2].item() - sums[3].item()) / pairs}
