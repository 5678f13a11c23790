"""DPO on the controller: preference pairs, no rollout engine, reward service or weight
push; only the learner group.

The reference model's summed logprobs of every (prompt, chosen) and (prompt,
rejected) are computed once, sharded over the learner ranks, cached on disk keyed by
the data files, tokenizer, reference weights, max length and prompt template, and
reused by later runs; then the reference leaves memory. `dpo.precompute_ref_logprobs:
false` keeps the reference in the loop instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import ray
import torch

from ...algorithms.batch import TrainBatch, concat, pack_rows
from ...algorithms.dpo import DPOLoss
from ...common.model_registry import cache_dir
from ...common.telemetry import Span, idle_fraction
from ...config import Recipe
from ...config.data import sources_of
from ..controller import on_learners
from ..data.pair_tokens import (
    PLAIN_TEMPLATE_ID,
    TokenizedPair,
    render_pairs,
)
from ..data.rows import data_files
from ..state import Run
from .base import PairAlgorithm


def pair_batch(pairs: list[TokenizedPair | None], pad_id: int) -> TrainBatch:
    """Rows 2i / 2i+1 = pair i's chosen / rejected reply after its left-padded prompt.
    A None pair is padding: a copy of a real row with an all-zero response mask."""
    real = next(p for p in pairs if p is not None)
    rows = [
        (q.prompt_ids, reply)
        for q in (p or real for p in pairs)
        for reply in (q.chosen_ids, q.rejected_ids)
    ]
    ids, attn, resp, width_p = pack_rows(rows, pad_id)
    for i, p in enumerate(pairs):
        if p is None:
            resp[2 * i : 2 * i + 2] = 0.0
    return TrainBatch(ids, attn, resp, width_p)


def _padded(pairs: list[TokenizedPair], multiple: int) -> list[TokenizedPair | None]:
    return list(pairs) + [None] * ((-len(pairs)) % multiple)


def _without_paths(tree: Any) -> Any:
    """A data block's settings less its `path`s (the files are hashed themselves)."""
    if isinstance(tree, dict):
        return {k: _without_paths(v) for k, v in tree.items() if k != "path"}
    if isinstance(tree, list):
        return [_without_paths(v) for v in tree]
    return tree


def cache_key(recipe: Recipe, model_path: str, template_id: str = PLAIN_TEMPLATE_ID) -> str:
    """Hash of everything the reference logprobs depend on."""
    h = hashlib.sha256()
    files = [f for s in sources_of(recipe.data.train) for f in data_files(s.path)]
    for f in (
        files
        + sorted(Path(model_path).glob("*.safetensors"))
        + sorted(p for p in Path(model_path).glob("*") if p.name.startswith(("tokenizer", "chat")))
    ):
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
        h.update(f.name.encode())
    h.update(
        json.dumps(
            [
                _without_paths(recipe.data.train.model_dump()),
                recipe.dpo.max_length,
                recipe.model.dtype,
                template_id,
                "identical-pairs-dropped",  # the pair list since identical pairs are dropped
            ]
        ).encode()
    )
    if recipe.model.adapter.type == "qlora":  # the reference is then the NF4 base, whose
        # blocks depend on the learner count (learner.adapters.nf4_block_sizes)
        h.update(f"qlora-nf4-{recipe.resources.learner.gpus}".encode())
    return h.hexdigest()[:24]


def reference_sums(
    learners: list[Any], pairs: list[TokenizedPair], pad_id: int, chunk: int
) -> torch.Tensor:
    """`[2N]` reference summed logprobs of every pair's rows (chosen, rejected, ...)."""
    out = []
    for i in range(0, len(pairs), chunk):
        part = pairs[i : i + chunk]
        batch = pair_batch(_padded(part, len(learners)), pad_id)
        sums = concat(on_learners(learners, "compute", batch, -1, "ref_logprobs")).sum(-1)
        out.append(sums[: 2 * len(part)])
    return torch.cat(out)


class DPO(PairAlgorithm):
    """`algorithm: dpo` (sigmoid or IPO, see `algorithms.dpo`)."""

    name = "dpo"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        d = recipe.dpo
        self.loss = DPOLoss(
            beta=d.beta,
            label_smoothing=d.label_smoothing,
            loss_type=d.loss_type,
            ipo_token_mean=d.ipo_token_mean,
        )
        self.temperature = 1.0
        self.ref_all: torch.Tensor | None = None

    def prepare(self, run: Run) -> None:
        """Tokenise the pairs with the prompt template their format calls for, then load
        or precompute the reference sums (freeing the reference on every rank)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(run.model_path)
        d = self.recipe.dpo
        done = render_pairs(run.data, tok, d.max_length, d.chat_template)
        print(done.description, flush=True)
        self.pairs, self.template_id = done.pairs, done.template_id
        g = torch.Generator().manual_seed(self.recipe.data.shuffle_seed)
        self.order = torch.randperm(len(self.pairs), generator=g).tolist()
        if self.recipe.dpo.precompute_ref_logprobs:
            self.ref_all = self.load_or_precompute(run)

    def load_or_precompute(self, run: Run) -> torch.Tensor:
        """Reference sums from the disk cache, or computed once and cached; frees the
        reference on every rank either way. Records what happened in precompute.json."""
        from safetensors.torch import load_file, save_file

        learners, recipe = run.roles.learners, self.recipe
        key = self.ref_key = cache_key(recipe, run.model_path, self.template_id)
        path = cache_dir() / "dpo_ref" / f"{key}.safetensors"
        t0 = time.time()
        if path.is_file():
            sums, hit = load_file(path)["ref_sums"], True
        else:
            chunk = len(learners) * max(1, recipe.train.micro_batch_size // 2) * 4
            sums, hit = reference_sums(learners, self.pairs, run.roles.pad_id, chunk), False
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file({"ref_sums": sums.contiguous()}, tmp)
            tmp.rename(path)
        ray.get([lw.free_reference.remote() for lw in learners])
        info = {
            "cache_hit": hit,
            "path": str(path),
            "pairs": len(self.pairs),
            "seconds": time.time() - t0,
            "bytes": path.stat().st_size,
        }
        (Path(run.run_dir) / "precompute.json").write_text(json.dumps(info, indent=1))
        print(
            f"reference logprobs: {'cache hit' if hit else 'computed'} ({len(self.pairs)} "
            f"pairs, {info['seconds']:.1f} s) {path}",
            flush=True,
        )
        return sums

    def checkpoint_state(self) -> dict[str, Any]:
        """The reference cache key (the sums a resume reloads) and the pair order's seed:
        step k trains on pairs `order[k·n : (k+1)·n]`, so the step is the position."""
        return {
            "ref_cache_key": getattr(self, "ref_key", None),
            "order_seed": self.recipe.data.shuffle_seed,
            "pairs": len(self.order),
        }

    def step(self, run: Run, step: int) -> tuple[dict[str, float], list[Span]]:
        learners, per_step = run.roles.learners, self.recipe.train.prompts_per_step
        t0 = time.time()
        idx = [self.order[(step * per_step + k) % len(self.order)] for k in range(per_step)]
        batch = pair_batch(_padded([self.pairs[i] for i in idx], len(learners)), run.roles.pad_id)
        if self.ref_all is not None:
            rows = torch.tensor([2 * i + j for i in idx for j in (0, 1)])
            batch.ref_sums = torch.cat([self.ref_all[rows], torch.zeros(len(batch) - len(rows))])
        else:
            batch.ref_sums = concat(
                on_learners(learners, "compute", batch, step, "ref_logprobs")
            ).sum(-1)
        batch.loss_denominator = float(per_step)
        t_ref = time.time()
        stats = on_learners(learners, "train_step", batch, step)[0]
        t_end = time.time()
        spans = [s for part in ray.get([lw.drain_spans.remote() for lw in learners]) for s in part]
        return {
            **stats,
            "time/step": t_end - t0,
            "time/reference": t_ref - t0,
            "time/train": t_end - t_ref,
            "tokens": float(batch.attention_mask.sum()),
            "learner_idle_fraction": idle_fraction(spans, "learner", len(learners), t0, t_end),
        }, spans
