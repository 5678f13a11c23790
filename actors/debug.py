"""`DebugSettings`: the rollout worker's test and benchmark knobs in one object (the
recipe's `debug` block: `rollout_delay_s`, `rollout_tail_every` / `rollout_tail_factor`,
`push_delay_s`, `fail_weight_push`), so the worker's constructor takes only what runs
in production. All off by default.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..weightsync import WeightSyncError
from .rollout import PromptRequest


@dataclass(frozen=True)
class DebugSettings:
    """Knobs that make a rollout worker slow or faulty on purpose.

    Attributes:
        delay_s: extra busy seconds per generate (with partial rollouts spread between
            its tokens, see `RolloutWorker._generate_partial`).
        fail_push: (worker_id, version): that worker refuses pushes of that version (a
            WeightSyncError), keeping its old weights.
        push_delay_s: extra seconds per `update_weights` (fault drills).
        tail: (every, factor): a `generate` call holding a sample whose uid's SHA-256
            (first 4 bytes, big-endian) is 0 modulo `every` sleeps `delay_s × factor`
            (`every` 0: off).
    """

    delay_s: float = 0.0
    fail_push: tuple[int, int] | None = None
    push_delay_s: float = 0.0
    tail: tuple[int, float] = (0, 1.0)

    def generate_delay(self, requests: list[PromptRequest], n: int) -> float:
        """Seconds a `generate` call of `requests` × `n` samples sleeps: `delay_s`, times
        the tail factor when one of its samples (uid `{group_id}-{k}`) is long."""
        every, factor = self.tail
        long = every > 0 and any(
            int.from_bytes(hashlib.sha256(f"{r.group_id}-{k}".encode()).digest()[:4], "big") % every
            == 0
            for r in requests
            for k in range(n)
        )
        return self.delay_s * (factor if long else 1.0)

    def check_push(self, worker_id: int, version: int) -> None:
        """Refuse the push `fail_push` names.

        Raises:
            WeightSyncError: `(worker_id, version)` is `fail_push`.
        """
        if self.fail_push == (worker_id, version):
            raise WeightSyncError(
                f"rollout worker {worker_id}: debug.fail_weight_push refused policy_version "
                f"{version}"
            )
