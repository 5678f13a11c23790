"""Asynchronous GRPO/PPO steps (`train.max_staleness: k ≥ 1`): rollouts for the next k
steps are generated and scored while the learner trains, with bounded staleness.

Structure:

- `RolloutStream` runs one producer thread on the controller. It takes
  `train.prompts_per_step` prompts at a time, sends each rollout worker its share
  (`generate`, one Ray call per worker) and, as each worker's share comes back, hands
  it to a scoring thread; every scored group (the samples of one prompt) goes to a
  ready list. The learner's batch is filled from finished groups in the order they
  finished (streaming: a slow engine does not hold the others' groups back).
  With partial rollouts (`rollout.partial`) on an engine that takes concurrent calls
  (`continuous_producer`: vLLM's AsyncLLM, which batches them continuously, or the 'hf'
  engine) there are no rounds: each group is its own request, sent to the worker with
  the fewest in flight as soon as the window has room and scored as soon as it
  returns, so a long sample holds one slot, not a round. vLLM's synchronous LLM keeps
  rounds (one batched call per engine).
  Multi-turn episodes and agents (`rollout.max_turns`, `rollout.agent`): a round is a
  batch of episodes (recipes/episodes/step.py), scored with the environment's rewards.
  Dynamic sampling (`grpo.dynamic_sampling`): a group whose rewards are all equal is
  set aside (its room goes back at once) and dropped at the next `take`, unless the
  step's budget of `grpo.max_rounds × prompts_per_step` scored groups runs out first
  (the step then trains on what it has, as recipes/algo/dynamic.py does).
- `async_step` is one step: take `prompts_per_step` fresh groups, write them to
  `rollouts/step_NNNNN.jsonl` (each sample with its `policy_version`), train, and push
  the new policy.

Staleness. A sample made by policy_version v trains at step s only if s − v ≤ k. The
producer keeps at most k × prompts_per_step groups generating, scoring or waiting (the
window, `producer_window`), which by itself bounds s − v by k; any group found older at
`take` (a slow tail, a resume) is dropped and counted in `dropped_stale`, never used.
With partial rollouts a sample's v is its oldest token's. `rollout.oversample` widens
the window (APRIL's over-sampling, Zhou et al. 2025: the first groups to finish fill a
step, the long ones finish later under newer weights), and `train.max_token_staleness`
m ≥ k then decides which of those train: a group is fresh at step s when
s − (its newest token's version) ≤ k and s − (its oldest token's) ≤ m.
`train.staleness_policy: budget` drops nothing for staleness (AReaL's staleness budget,
Fu et al. 2025): the window alone bounds how far generation runs ahead (the producer
pauses while it is full), every group trains, the most overdue first, and one past the
bounds (a long sample continued across pushes, a group left waiting) is weighed by
`train.correction`; `staleness_max` reports how old.

Concurrency (the order, written down):
1. The producer starts a generation round only when no push is waiting and the window
   holds a round more; the round's Ray calls all go out at once and the round ends when
   every engine has answered. With partial rollouts it sends one group at a time on the
   same conditions, and "generating" means any request in flight.
2. A push (`paused()`) first stops new rounds and waits for the round in flight to end,
   so a push lands between generation requests: an engine never mixes two policy
   versions inside one sample. With partial rollouts (`rollout.partial`) it stops new
   rounds only: the push reaches the engines while they generate, each pauses between
   tokens, loads and resumes (actors/partial.py), and its samples record the version
   of every token; a group's staleness counts from its oldest token.
3. An evaluation (`eval:`) pauses the same way and also waits for the scorer to go
   idle, so it samples exactly the policy version it names and scores on the reward
   client alone.
4. Only the main thread trains, pushes, evaluates and checkpoints; the producer only
   generates and scores. A dead rollout worker stops the run (resume from the last checkpoint)
   rather than being replaced under a concurrent push.

Checkpoints and resume (each prompt trains once): the data position saved carries, as
`pending`, the data positions of every prompt drawn and neither trained on nor dropped
(generating, scoring or ready); a resume, or a learner restart (recipes/recovery.py,
which closes this stream), generates those first under the checkpoint's policy, then
continues from the position. With it go the samples those prompts had so far
(`prefixes`, recipes/async_loop/inflight.py: read from the engines between tokens, and
the groups generated whole), which a resume continues instead of sampling again.

Telemetry: the controller sees when each engine's request went out and came back;
those intervals (and the in-flight part of a request still running at the end of a
step) are the rollout side's `generate` spans, so idle fractions stay right while both
sides run at once.

The wing: `groups` (a scored group and `take_fresh`, pure), `stream` (the producer,
`RolloutStream`), `step` (`async_step`).
"""

from .groups import Group, take_fresh
from .step import StreamPosition, async_step
from .stream import RolloutStream

__all__ = ["Group", "RolloutStream", "StreamPosition", "async_step", "take_fresh"]
