"""The state every route of `posttrain serve` reads (FastAPI dependency `service_state`):
the token, the root, the running roles (`stack.Stack`), the durable registry and the
per-role scheduler, plus the few operations several routes share (restoring sessions
after a restart, putting a sampler's adapter on the engines).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request

from ..config.service import ServiceConfig
from .errors import UserError
from .registry import ModelRecord, Registry, SamplerRecord
from .scheduler import Scheduler


@dataclass
class ServiceState:
    """One service: `stack` (the roles; None only in tests of the routes' checks),
    `registry` (durable), `scheduler` (queues and futures)."""

    token: str
    root: Path
    cfg: ServiceConfig
    stack: Any
    registry: Registry
    scheduler: Scheduler = field(default_factory=Scheduler)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    last_seen: dict[str, float] = field(default_factory=dict)  # session → last heartbeat
    on_engines: set[str] = field(default_factory=set)  # adapters the engines were given
    _saver: threading.Thread | None = None

    @classmethod
    def start(
        cls, cfg: ServiceConfig, root: Path, token: str, address: str | None = None
    ) -> ServiceState:
        """Start the roles (`stack.Stack`) and continue every model the registry under
        `root` lists from its newest saved state."""
        from .stack import Stack

        root.mkdir(parents=True, exist_ok=True)
        registry = Registry.load(root)
        stack = Stack(cfg, root, address)
        wait = cfg.sessions.batch_wait_s if cfg.sessions.batch > 1 else 0.0
        st = cls(token, root, cfg, stack, registry, Scheduler(wait))
        try:
            for rec in registry.models.values():
                stack.open(rec.model_id, rec.rank, rec.seed, rec.train_attn, rec.train_mlp)
                if rec.saved is not None:
                    stack.load(rec.model_id, Path(rec.saved), optimizer=True)
                rec.steps = rec.saved_steps
            registry.save()
        except BaseException:
            stack.stop()
            raise
        if cfg.sessions.save_every_s > 0:
            st._saver = threading.Thread(target=st._save_on_cadence, daemon=True)
            st._saver.start()
        threading.Thread(target=st._reap_on_cadence, daemon=True).start()
        return st

    def _reap_on_cadence(self) -> None:
        while True:
            time.sleep(min(10.0, self.cfg.sessions.idle_timeout_s))
            self.reap_idle()

    def stop(self) -> None:
        self.scheduler.shutdown()
        if self.stack is not None:
            self.stack.stop()

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}-{secrets.token_hex(3)}"

    @property
    def base_name(self) -> str:
        return self.cfg.base_name

    def check_base(self, name: Any) -> str:
        """`name` if it is the base model this service trains; else a 404 naming the
        served one (never a path of this machine)."""
        if name != self.base_name:
            raise UserError(
                "base_model",
                f"{name!r} is not served here; this service serves {self.base_name!r}",
                404,
            )
        return name

    def session(self, sid: Any) -> list[str]:
        if sid not in self.registry.sessions:
            raise UserError("session_id", f"{sid!r} is not a live session", 404)
        self.last_seen[sid] = time.time()
        return self.registry.sessions[sid]

    def model(self, mid: Any) -> ModelRecord:
        if mid not in self.registry.models:
            raise UserError("model_id", f"{mid!r} is not a live training model", 404)
        rec = self.registry.models[mid]
        self.last_seen[rec.session_id] = time.time()
        return rec

    def reap_idle(self, now: float | None = None) -> int:
        """Cancel the waiting requests of sessions silent for `sessions.idle_timeout_s`
        (a dead client); returns how many were cancelled."""
        now = time.time() if now is None else now
        limit = self.cfg.sessions.idle_timeout_s
        dropped = 0
        for sid, mids in list(self.registry.sessions.items()):
            if now - self.last_seen.get(sid, now) > limit:
                dropped += sum(self.scheduler.drop(m) for m in mids)
        return dropped

    def sampler(self, key: Any) -> SamplerRecord:
        if key not in self.registry.samplers:
            raise UserError("sampling_session_id", f"{key!r} is not a sampling session", 404)
        return self.registry.samplers[key]

    def submit(
        self,
        queue: str,
        lane: str,
        fn: Any,
        model_id: str | None = None,
        batch: Any = None,
        **extra: Any,
    ) -> dict:
        """Queue `fn` on `queue` in `lane`'s order (batchable with other lanes' calls
        with `batch`, a `scheduler.Batchable`); the SDK's future body."""
        rid = self.scheduler.submit(queue, lane, fn, batch)
        return {"request_id": rid, "model_id": model_id, **extra}

    # -- shared operations (run on the learner queue) ---------------------------------
    def save_model(self, rec: ModelRecord, name: str) -> Path:
        """Adapter, AdamW state and step of `rec` to `root/<model>/weights/<name>`."""
        folder = self.root / rec.model_id / "weights" / name
        self.stack.save(rec.model_id, folder, optimizer=True)
        rec.saved, rec.saved_steps = str(folder), rec.steps
        self.registry.save()
        return folder

    def put_on_engines(self, s: SamplerRecord) -> None:
        """Push sampler `s`'s adapter to every engine (again: after a restart, or when an
        engine's slots evicted it): a scratch session on the learner loads its folder and
        publishes it under its name. Runs on the learner queue."""
        if s.adapter is None or s.adapter in self.on_engines:
            return
        if s.folder is None or s.model_id is None:
            raise UserError("sampling_session_id", "its weights were never saved", 404)
        scratch = f"restore-{s.adapter}"
        self.stack.open(scratch, s.rank, 0, True, True)
        try:
            self.stack.load(scratch, Path(s.folder), optimizer=False)
            self.stack.publish(scratch, s.adapter, s.version)
        finally:
            self.stack.close(scratch)
        self.on_engines.add(s.adapter)

    def _save_on_cadence(self) -> None:
        every = self.cfg.sessions.save_every_s
        while True:
            time.sleep(every)
            for rec in list(self.registry.models.values()):
                if rec.steps != rec.saved_steps:
                    self.scheduler.submit(
                        "learner", rec.model_id, lambda r=rec: self.save_model(r, "autosave")
                    )


def service_state(request: Request) -> ServiceState:
    """The FastAPI dependency of every route."""
    return request.app.state.service


State = Annotated[ServiceState, Depends(service_state)]  # a route's `st: State`
