"""The `reward_model` reward component: a local sequence-classification folder (one
label, e.g. what `algorithm: reward_model` saves) scores items inside the reward
service, in batches.

Rendering: the item's `messages` (else its `prompt` as one user message) and then the
response as the assistant's turn, with the folder's chat template, exactly as the
reward-model training renders preference pairs (common/chat_tokens.py): prompt with
the generation prompt, the reply up to and including its end-of-turn token. Without a
chat template (or `chat_template: false`): raw prompt + response text + EOS. A sequence
over `max_length` tokens keeps its end. Rows are left-padded with the config's pad id
and the head is read at each row's last attended token, its closing EOS
(`common.score_head.sequence_scores`, as the reward-model training reads it), whatever
the pad id.

Normalisation: `fixed` is (score − mean) / std; `running` uses the mean and std of every
raw score this process has produced, this batch included (Welford), so a retried batch
may get different rewards: scoring is then not idempotent by uid.

Concurrency: one forward at a time (a lock), `batch_size` sequences each; requests
arriving together wait for each other. Limits: the folder is trusted (transformers
loads it with `trust_remote_code` off); nothing is downloaded.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from ..common.chat_tokens import chat_prompt, chat_reply, plain_ids, stop_ids
from ..common.model_folder import model_folder_problem
from ..common.numbers import finite32
from ..config.rewards import RewardModelReward
from .protocol import ScoreItem


class RunningStats:
    """Mean and standard deviation of every value seen so far (Welford 1962)."""

    def __init__(self) -> None:
        self.count, self.mean, self._m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        """Population standard deviation (0 before two values)."""
        return math.sqrt(self._m2 / self.count) if self.count > 1 else 0.0


class RewardModelScorer:
    """Scores batches of items with one reward-model folder.

    Raises (at construction):
        ValueError: `spec.path` is not a loadable sequence-classification folder: missing,
            incomplete or broken (common/model_folder.py, checked before loading), or
            refused by transformers; the message names the folder.
    """

    def __init__(self, spec: RewardModelReward):
        import torch
        from safetensors import SafetensorError
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if (problem := model_folder_problem(spec.path)) is not None:
            raise ValueError(f"reward {spec.name!r}: {problem}")
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec, self.torch = spec, torch
        dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.path)
            self.model = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=dtype)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError) as e:
            raise ValueError(
                f"reward {spec.name!r}: {spec.path} cannot be loaded as a "
                f"sequence-classification model ({type(e).__name__}: {e})"
            ) from e
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward {spec.name!r}: {spec.path} has "
                f"{self.model.config.num_labels} labels; a reward model has one"
            )
        tok = self.tokenizer
        if self.model.config.pad_token_id is None:  # its pooling needs one
            self.model.config.pad_token_id = (
                tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            )
        self.pad_id = self.model.config.pad_token_id
        self.model.to(spec.device).eval()
        self.chat = spec.chat_template and bool(getattr(tok, "chat_template", None))
        self.stops = stop_ids(tok)
        self.stats = RunningStats()
        self.lock = threading.Lock()

    def token_ids(self, item: ScoreItem) -> list[int]:
        """`[L]` ids of the item's conversation and response (module docstring)."""
        if self.chat:
            messages = item.messages or [{"role": "user", "content": item.prompt}]
            prompt, text = chat_prompt(self.tokenizer, messages)
            reply = chat_reply(self.tokenizer, messages, text, item.response, self.stops)
        else:
            prompt, reply = plain_ids(self.tokenizer, item.prompt, item.response)
        return (prompt + reply)[-self.spec.max_length :]

    def raw_scores(self, items: list[ScoreItem]) -> list[float]:
        """The model's score of each item, in order (no normalisation)."""
        from ..common.score_head import sequence_scores

        torch, out = self.torch, []
        rows = [self.token_ids(i) for i in items]
        with self.lock, torch.no_grad():
            for start in range(0, len(rows), self.spec.batch_size):
                chunk = rows[start : start + self.spec.batch_size]
                width = max(len(r) for r in chunk)
                ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for k, r in enumerate(chunk):
                    ids[k, width - len(r) :] = torch.tensor(r)
                    mask[k, width - len(r) :] = 1
                dev = self.spec.device
                scores = sequence_scores(self.model, ids.to(dev), mask.to(dev))
                out += scores.cpu().tolist()
        return out

    def __call__(self, item: ScoreItem) -> tuple[float, dict[str, Any]]:
        """One item alone (`score_batch` of one).

        Raises:
            ValueError: the model's score is not a finite number.
        """
        got = self.score_batch([item])[0]
        if isinstance(got, Exception):
            raise got
        return got

    def score_batch(self, items: list[ScoreItem]) -> list[tuple[float, dict[str, Any]] | Exception]:
        """`(reward, details)` per item: the normalised score, and the raw one in
        details (`raw`) when normalising. An item whose raw score is NaN or infinite (a
        broken or overflowing model) gets a `ValueError` in its place, and stays out of
        the running statistics."""
        raw = self.raw_scores(items)
        finite = [r for r in raw if finite32(r)]
        s = self.spec
        if s.normalize == "fixed":
            mean, std = s.mean, s.std
        elif s.normalize == "running":
            with self.lock:
                self.stats.update(finite)
                mean, std = self.stats.mean, self.stats.std
        out: list[tuple[float, dict[str, Any]] | Exception] = []
        for r in raw:
            if not finite32(r):
                out.append(ValueError(f"{s.path} gave the score {r!r}, not a finite number"))
            elif s.normalize == "none":
                out.append((r, {}))
            else:
                out.append(((r - mean) / std if std > 0 else r - mean, {"raw": r}))
        return out
