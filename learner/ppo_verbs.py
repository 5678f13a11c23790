"""PPO verbs of `LearnerWorker` (a mixin): the critic and the PPO update.

The critic is the policy's architecture with a scalar head
(`AutoModelForTokenClassification`, one label), initialised from the policy's weights
or its own path, sharded by FSDP2 like the policy, with its own AdamW and LR. Every
verb is collective: all ranks call it with equally sized shards.

With `model.adapter` (LoRA/QLoRA) only the policy gets an adapter: the critic stays a
full float32 model with full fine-tuning, because its scalar head and value scale
start untrained and a low-rank update of a frozen LM is a poor fit for them. Its
memory is then the larger part of the learner's; a LoRA critic is future work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from posttrain.learner.batch import TrainBatch
from posttrain.algorithms.common import aggregate_loss, clipped_policy_loss
from posttrain.algorithms.ppo import clipped_value_loss


class PPOVerbs:
    """Mixed into LearnerWorker; uses its policy, spans and settings."""

    def _setup_critic(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForTokenClassification

        path = self.s.critic_path or self.s.model_path
        critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1,
                                                                 dtype=torch.float32)
        critic.config.use_cache = False
        mp = MixedPrecisionPolicy(param_dtype=self._dtype(), reduce_dtype=torch.float32)
        for layer in critic.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(critic, mp_policy=mp)
        self.critic = critic
        self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=self.s.critic_lr,
                                                  betas=self.s.betas)

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        """`[b, T]` values; column t is read where token t is predicted (position t−1)."""
        positions = (mb.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                          position_ids=positions).logits[..., 0].float()
        values = torch.zeros(mb.input_ids.shape, dtype=torch.float32)
        values[:, mb.response_start:] = out[:, mb.response_start - 1:-1]
        return values

    @torch.no_grad()
    def compute_values(self, shard: TrainBatch, step: int) -> torch.Tensor:
        """`[b, T]` critic values of this rank's shard, 0 off the response mask."""
        with self.spans.span("forward", step):
            parts = [self._values(mb) for mb in self._micro_batches(shard)]
        return torch.cat(parts) * shard.response_mask

    def ppo_train_step(self, shard: TrainBatch, denominator: float,
                       step: int) -> dict[str, float]:
        """One PPO mini-batch update: clipped policy loss (+ k3 KL term when
        kl_mode is 'loss') and clipped value loss, one AdamW step each.

        Args:
            shard: rows with old_logprobs, advantages (whitened), returns, values (the
                critic's, before this update) and, with KL, ref_logprobs.
            denominator: response tokens of this mini-batch over all ranks.
        """
        s = self.s
        self.policy.train()
        self.critic.train()
        sums = torch.zeros(6, dtype=torch.float64)  # pg, vf, clipped, vclipped, kl, tokens
        n = s.micro_batch_size
        for i in range(0, len(shard), n):
            mb, m = shard.select(slice(i, i + n)), shard.response_mask[i:i + n]
            with self.spans.span("forward", step):
                lp = self._logprobs(self.policy, mb)
                t = clipped_policy_loss(lp, mb.old_logprobs, mb.advantages, s.clip_low,
                                        s.clip_high, ref_logprobs=mb.ref_logprobs,
                                        kl_coef=s.kl_coef)
                pg = aggregate_loss(t.loss, m, denominator)
                v = self._values(mb)
                vl, vclip = clipped_value_loss(v, mb.values, mb.returns, s.cliprange_value)
                vf = aggregate_loss(vl, m, denominator)
            with self.spans.span("backward", step):
                ((pg + vf) * self.world).backward()  # disjoint parameters: one backward
            sums += torch.tensor([pg.item(), vf.item(), (t.clipped * m).sum().item(),
                                  (vclip * m).sum().item(), (t.kl * m).sum().item(),
                                  m.sum().item()], dtype=torch.float64)
        stats = self._optimizer_step(step)
        with self.spans.span("optimizer", step):
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), s.max_grad_norm)
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        tokens = max(sums[5].item(), 1.0)
        return {**stats, "loss": sums[0].item(), "value_loss": sums[1].item(),
                "clip_fraction": sums[2].item() / tokens,
                "value_clip_fraction": sums[3].item() / tokens, "kl": sums[4].item() / tokens}
