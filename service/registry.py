"""What the service knows of its clients, kept durable under `--root`: sessions, training
models (LoRA sessions on the learner) and sampler weights, written to
`root/service.json` atomically after every change. A service started again on the same
root lists the same sessions and continues each model from its newest saved state
(`save_state`, or the `sessions.save_every_s` cadence).

Files under root: `<model>/weights/<name>/` (save_state: adapter, AdamW state, step,
per learner rank), `<model>/sampler_weights/<name>/` (the adapter a sampler serves),
`roles/` (the roles' logs and cluster record).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

FILE = "service.json"


@dataclass
class ModelRecord:
    """A LoRA training model: its spec, its optimizer steps taken, and its newest saved
    state folder (None: never saved; a restart starts it afresh from its seed)."""

    model_id: str
    session_id: str
    base_model: str
    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    steps: int = 0
    saved: str | None = None
    saved_steps: int = 0


@dataclass
class SamplerRecord:
    """Sampler weights: a model's adapter frozen at `version` (`adapter`: the name the
    engines serve it under, `folder`: its files under root), or the base model
    (`model_id` None)."""

    base_model: str
    model_id: str | None = None
    rank: int = 0
    adapter: str | None = None
    version: int = 0
    path: str | None = None  # tinker://<model>/sampler_weights/<name>, when named
    folder: str | None = None


@dataclass
class Registry:
    """Sessions, models and samplers of one service root."""

    root: Path
    sessions: dict[str, list[str]] = field(default_factory=dict)
    models: dict[str, ModelRecord] = field(default_factory=dict)
    samplers: dict[str, SamplerRecord] = field(default_factory=dict)
    version: int = 0  # the newest policy_version pushed to the engines
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_version(self) -> int:
        with self.lock:
            self.version += 1
            return self.version

    def save(self) -> None:
        """Write `root/service.json` (a new file renamed over the old: never half-written)."""
        with self.lock:
            body = {
                "sessions": self.sessions,
                "models": {k: asdict(v) for k, v in self.models.items()},
                "samplers": {k: asdict(v) for k, v in self.samplers.items()},
                "version": self.version,
            }
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.root / FILE)

    @classmethod
    def load(cls, root: Path) -> Registry:
        """The registry of `root` (empty when the service never ran there).

        Raises:
            ValueError: `root/service.json` is not one this service wrote (named).
        """
        reg = cls(root)
        path = root / FILE
        if not path.is_file():
            return reg
        try:
            body = json.loads(path.read_text())
            reg.sessions = {k: list(v) for k, v in body["sessions"].items()}
            reg.models = {k: ModelRecord(**v) for k, v in body["models"].items()}
            reg.samplers = {k: SamplerRecord(**v) for k, v in body["samplers"].items()}
            reg.version = int(body["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}: not a posttrain serve registry ({type(e).__name__}: {e}); "
                "start the service on another --root or move this file away"
            ) from None
        return reg
