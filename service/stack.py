"""The roles behind `posttrain serve`: the FSDP2 `LearnerWorker` group and the
`RolloutWorker` engines of a recipe, started through the recipes' own start-up path
(`recipes.roles.init_ray` / `start_roles` / `stop_roles`), and the verbs the service's
routes call on them. Nothing here trains or samples itself: each method translates one
service request into the roles' verbs.

- One base model on the learner group (sharded by FSDP2 as a recipe's is) and one in
  each engine, whatever the number of sessions. A session is a LoRA adapter and its
  AdamW state on the learner (`learner/sessions.py`), switched per request.
- Sampler weights reach the engines as named LoRA adapters through the recipe's weight
  transport (`weightsync.push` with the session's publisher), with the delivery proof.

Concurrency: the learner verbs are collectives, so one thread calls them at a time (the
service's learner queue, `service/scheduler.py`); sampling runs on the engines from the
sampler queue, one request per engine at a time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..actors.adapter_slots import AdapterNotHeld
from ..algorithms.tinker import SessionBatch, stack_batches
from ..config.service import ServiceConfig
from .wire import WireDatum


class AdapterMissing(RuntimeError):
    """An engine no longer holds this sampler's adapter (its slots evicted it): push it
    again (`ServiceState.put_on_engines`) and retry."""


@dataclass
class RoleCounts:
    """What the status route shows of the roles: verbs run per learner rank and per
    engine, and busy seconds of each side since start."""

    learner_verbs: dict[int, dict[str, int]] = field(default_factory=dict)
    engine_verbs: dict[int, dict[str, int]] = field(default_factory=dict)
    learner_busy_s: float = 0.0
    engine_busy_s: float = 0.0
    deliveries: dict[str, dict[str, Any]] = field(default_factory=dict)  # adapter name → proof

    def count(self, table: dict[int, dict[str, int]], who: int, verb: str) -> None:
        row = table.setdefault(who, {})
        row[verb] = row.get(verb, 0) + 1


class ServeAlgorithm:
    """What `recipes.roles.start_roles` reads of an algorithm, for the service: engines and
    weight pushes, no reward service, no reference, no critic, and a learner that holds
    sessions (`sessions`) instead of one recipe's optimizer."""

    name = "sft"  # the learner's default loss module; sessions choose theirs per request
    uses_rollouts = True
    load_reference = False
    reference_path = None
    critic = None
    temperature = 1.0
    head = "lm"

    def __init__(self, sessions: Any) -> None:
        from ..algorithms.sft import SFTLoss

        self.loss = SFTLoss()
        self.sessions = sessions


def role_recipe(cfg: ServiceConfig) -> Any:
    """The `Recipe` the recipes' start-up path reads, for this service: its model with one
    LoRA slot of `sessions.max_rank` (alpha = rank: scale 1, as Tinker's alpha = rank gives
    every session), adapter-only weight sync, the given resources and engine. Built with
    `model_construct`: a service has no data or rewards for the recipe's cross-checks."""
    from ..config import Recipe
    from ..config.adapter import AdapterConfig
    from ..config.recipe import ModelConfig, RolloutConfig, TrainConfig

    s = cfg.sessions
    adapter = AdapterConfig(
        type="lora", r=s.max_rank, alpha=float(s.max_rank), target_modules=s.target_modules
    )
    sync = cfg.weight_sync.model_copy(update={"adapter_mode": "adapter"})
    return Recipe.model_construct(
        name="serve",
        algorithm="sft",
        model=ModelConfig(path=cfg.model.path, dtype=cfg.model.dtype, adapter=adapter),
        rollout=RolloutConfig(engine=cfg.rollout.engine, vllm=cfg.rollout.vllm),
        rewards=[],
        train=TrainConfig(
            steps=1, prompts_per_step=1, micro_batch_size=s.micro_batch_size, seed=cfg.seed
        ),
        resources=cfg.resources,
        weight_sync=sync,
    )


def datum_batch(d: WireDatum) -> SessionBatch:
    """One datum as a one-row `SessionBatch` (`[1, N]`); `weights` 1 on every position
    when not sent (the losses' default: every position counts)."""
    n = d.tokens.size
    inputs = {
        k: torch.from_numpy(v.astype(np.float32))[None]
        for k, v in d.inputs.items()
        if k != "target_tokens"
    }
    inputs.setdefault("weights", torch.ones(1, n))
    return SessionBatch(
        torch.from_numpy(d.tokens.astype(np.int64))[None],
        torch.ones(1, n),
        torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))[None],
        inputs,
    )


class Stack:
    """The running roles of one service and the verbs its routes call.

    Args:
        cfg: the service configuration.
        root: the service's folder (the roles' logs and cluster record go to `root/roles`).
        address: a Ray cluster to join (as `posttrain run --address`), else an embedded one.
    """

    def __init__(self, cfg: ServiceConfig, root: Path, address: str | None = None) -> None:
        import ray

        from ..common.model_registry import resolve_model_path
        from ..learner.settings import SessionSettings
        from ..recipes.roles import init_ray, start_roles

        self.cfg = cfg
        self.model_path = str(resolve_model_path(cfg.model.path))
        recipe = role_recipe(cfg)
        self.recipe = recipe
        s = cfg.sessions
        sessions = SessionSettings(
            max_rank=s.max_rank,
            target_modules=tuple(s.target_modules),
            max_sessions=s.max_sessions,
            batch_sessions=s.batch,
        )
        run_dir = root / "roles"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            init_ray(recipe, address)
        self.roles = start_roles(
            recipe,
            ServeAlgorithm(sessions),
            self.model_path,
            run_dir,
            adapter_slots=s.adapter_slots,
        )
        self.world = len(self.roles.learners)
        self.counts = RoleCounts()
        self._engine_turn = itertools.count()
        self._engine_locks = [threading.Lock() for _ in self.roles.rollout]
        self.started = time.time()
        from transformers import AutoConfig

        conf = AutoConfig.from_pretrained(self.model_path)
        self.vocab = int(conf.vocab_size)
        self.context = int(getattr(conf, "max_position_embeddings", 0) or 1 << 30)

    # -- learner verbs (one caller at a time: the learner queue) ------------------------
    @contextmanager
    def _learner_busy(self, verb: str) -> Iterator[None]:
        """Time the learner group's call of `verb` and count it on every rank."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.counts.learner_busy_s += time.perf_counter() - t0
        for r in range(self.world):
            self.counts.count(self.counts.learner_verbs, r, verb)

    def _on_learners(self, verb: str, *args: Any) -> list[Any]:
        import ray

        with self._learner_busy(verb):
            return ray.get([getattr(lw, verb).remote(*args) for lw in self.roles.learners])

    def open(self, mid: str, rank: int, seed: int, attn: bool, mlp: bool) -> dict:
        """A new LoRA session `mid` on every learner rank (its adapter from `seed`; its
        rank checked by the route, `routes_train.create_model`)."""
        return self._on_learners("open_session", mid, rank, seed, attn, mlp)[0]

    def close(self, mid: str) -> None:
        self._on_learners("close_session", mid)

    def forward_backward(
        self, mid: str, data: list[WireDatum], loss_fn: str, config: dict, backward: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum {`logprobs`, `elementwise_loss`} `[N]` float32 and the summed metrics;
        with `backward` the summed loss's gradient accumulates in the session."""
        return self.forward_backward_many([(mid, data, loss_fn, config)], backward)[0]

    def forward_backward_many(
        self, items: list[tuple[str, list[WireDatum], str, dict]], backward: bool
    ) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        """`forward_backward` of several sessions' requests (each `(model, data, loss_fn,
        config)`, one session at most once) in ONE learner pass (the learner's
        `sessions_forward_backward`: each session's rows see only its adapter, its
        gradients go only to its buffers). Each request's rows are split over the learner
        ranks (padded with empty rows to a multiple of the ranks)."""
        import ray

        world = self.world
        per_rank: list[list[tuple]] = [[] for _ in range(world)]
        for mid, data, loss_fn, config in items:
            rows = [datum_batch(d) for d in data]
            names = tuple(sorted({k for row in rows for k in row.inputs}))
            per = -(-len(data) // world)
            for r in range(world):  # a rank past the data gets filler rows only
                shard = stack_batches(rows[r * per : (r + 1) * per], per, names)
                per_rank[r].append((mid, shard, loss_fn, config))
        with self._learner_busy("forward_backward" if backward else "forward"):
            if len(items) == 1:
                refs = [
                    lw.session_forward_backward.remote(*mine[0], backward)
                    for lw, mine in zip(self.roles.learners, per_rank, strict=True)
                ]
                outs = [[o] for o in ray.get(refs)]
            else:
                refs = [
                    lw.sessions_forward_backward.remote(mine, backward)
                    for lw, mine in zip(self.roles.learners, per_rank, strict=True)
                ]
                outs = ray.get(refs)
        results = []
        for k, (_, data, _, _) in enumerate(items):
            mine = [outs[r][k] for r in range(world)]
            metrics: dict[str, float] = {}
            for o in mine:
                for key, v in o["metrics"].items():
                    metrics[key] = metrics.get(key, 0.0) + float(v)
            per = -(-len(data) // world)  # datum i is row i % per of rank i // per
            outputs = []
            for i, d in enumerate(data):
                o, row, n = mine[i // per], i % per, d.tokens.size
                outputs.append(
                    {
                        "logprobs": o["logprobs"][row, :n].numpy(),
                        "elementwise_loss": o["elementwise_loss"][row, :n].numpy(),
                    }
                )
            results.append((outputs, metrics))
        return results

    def optim_step(self, mid: str, adam: dict[str, float]) -> dict[str, float]:
        return self._on_learners("session_optim_step", mid, adam)[0]

    def save(self, mid: str, folder: Path, optimizer: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._on_learners("save_session", mid, str(folder), optimizer)

    def load(self, mid: str, folder: Path, optimizer: bool) -> None:
        self._on_learners("load_session", mid, str(folder), optimizer)

    def checksum(self, mid: str) -> str:
        """The session's adapter checksum (tests: isolation), equal on every rank."""
        sums = self._on_learners("session_checksum", mid)
        return sums[0]

    def publish(self, mid: str, name: str, version: int) -> None:
        """Push session `mid`'s adapter to every engine as adapter `name`, policy_version
        `version`, with the delivery proof (`weightsync.push`).

        Raises:
            WeightSyncError: an engine did not load it, or holds other tensors.
        """
        from ..weightsync import push

        with self._learner_busy("publish_session"):
            push(
                self.roles.learners,
                self.roles.rollout,
                version,
                self.cfg.weight_sync.timeout_s,
                publisher=lambda lw: lw.publish_session.options(num_returns="streaming").remote(
                    mid, version, name
                ),
            )
        for e in range(len(self.roles.rollout)):
            self.counts.count(self.counts.engine_verbs, e, "update_weights")
        self.counts.deliveries[name] = {"version": version, "engines": len(self.roles.rollout)}

    # -- engine verbs (the sampler queue) -----------------------------------------------
    def sample(
        self, adapter: str | None, prompt: list[int], settings: Any, stop_ids: list[int] | None
    ) -> list[tuple[list[int], list[float], str]]:
        """`settings.n` samples of `prompt` on the next engine with adapter `adapter`
        (None: the base), each (tokens, per-token logprobs, stop reason)."""
        from dataclasses import replace

        import ray

        e = next(self._engine_turn) % len(self.roles.rollout)
        worker = self.roles.rollout[e]
        if stop_ids is not None:
            settings = replace(settings, stop_token_ids=tuple(stop_ids))
        with self._engine_locks[e]:
            t0 = time.perf_counter()
            try:  # one request of n samples (vLLM: one prefill, children seeded apart)
                samples, _ = ray.get(worker.generate_ids.remote([prompt], settings, -1, adapter))
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, AdapterNotHeld):
                    raise AdapterMissing(adapter) from None
                raise
            finally:
                self.counts.engine_busy_s += time.perf_counter() - t0
        self.counts.count(self.counts.engine_verbs, e, "sample")
        return [(s.token_ids, s.logprobs, s.finish_reason) for s in samples]

    def status(self) -> dict[str, Any]:
        wall = max(time.time() - self.started, 1e-9)
        c = self.counts
        return {
            "learner_ranks": self.world,
            "engines": len(self.roles.rollout),
            "engine": self.cfg.rollout.engine,
            "learner_verbs": {str(k): v for k, v in c.learner_verbs.items()},
            "engine_verbs": {str(k): v for k, v in c.engine_verbs.items()},
            "learner_idle_fraction": max(0.0, 1.0 - c.learner_busy_s / wall),
            "rollout_idle_fraction": max(
                0.0, 1.0 - c.engine_busy_s / (wall * max(len(self.roles.rollout), 1))
            ),
            "deliveries": c.deliveries,
        }

    def stop(self) -> None:
        """Stop every role this stack started (and the embedded Ray it started)."""
        import ray

        from ..recipes.roles import stop_roles

        stop_roles(self.roles)
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
