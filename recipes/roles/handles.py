"""What a run holds of its running roles: their handles (`Roles`), how to start each
again (`RelaunchSpecs`, `LocalServiceLaunch`) and what the run counts of them
(`RunCounters`)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...rewards.client import RewardSet, start_local_service
from ...weightsync import GroupStore, TransportSettings
from ..episodes.vf1 import Drivers
from ..placement import Placement
from .env_server import EnvironmentServer
from .settings import RolloutSpec


@dataclass
class LocalServiceLaunch:
    """Arguments of `start_local_service`, kept to restart a dead service on the same
    port with the same token (so the run's client keeps working)."""

    components_json: str
    port: int
    token: str
    log_path: Path
    workers: int

    def start(self) -> subprocess.Popen:
        return start_local_service(
            self.components_json, self.port, self.token, self.log_path, workers=self.workers
        )


@dataclass(frozen=True)
class RelaunchSpecs:
    """How to start each role again, fixed once the roles run; recovery reads them.

    Attributes:
        reward: the local reward service's launch (same port and token), or None.
        rollout: how to start one rollout worker, or None (no rollout side).
        learners: `(transport, resume_from) -> learner actors`: the whole learner group.
        transport: the weight transport the roles were given.
    """

    reward: LocalServiceLaunch | None = None
    rollout: RolloutSpec | None = None
    learners: Callable[[TransportSettings, str | None], list[Any]] | None = None
    transport: TransportSettings | None = None


@dataclass
class RunCounters:
    """What a run counts about its roles. Only the controller (a push, a replaced rollout
    worker or reward service) and the learner recovery change these.

    Attributes:
        reward_restarts: local reward service restarts so far.
        rollout_restarts: rollout workers replaced so far.
        learner_restarts: learner groups restarted so far.
        policy_version: what every engine holds (the newest push).
        last_push_bytes: tensor bytes of the newest weight push (a delta's encoded bytes
            with `weight_sync.delta`).
        last_push_changed: share of the pushed elements that changed since the previous
            push (1.0 for a full push without `weight_sync.delta`).
    """

    reward_restarts: int = 0
    rollout_restarts: int = 0
    learner_restarts: int = 0
    policy_version: int = 0
    last_push_bytes: int = 0
    last_push_changed: float = 1.0


@dataclass
class Roles:
    """Handles of every running role of one job (no rollout side for DPO), with how to
    start each again (`specs`) and what the run counts of them (`counters`)."""

    learners: list[Any]
    placement: Placement
    pad_id: int = 0
    rollout: list[Any] = field(default_factory=list)
    reward: RewardSet | None = None
    reward_proc: subprocess.Popen | None = None
    group: GroupStore | None = None  # the push group's rendezvous (collective transport)
    env_server: EnvironmentServer | None = None  # rollout.environment.serve's server
    # a verifiers v1 environment's drivers, kept up between steps (recipes/episodes/vf1.py)
    vf1_drivers: Drivers = field(default_factory=Drivers)
    specs: RelaunchSpecs = field(default_factory=RelaunchSpecs)
    counters: RunCounters = field(default_factory=RunCounters)
