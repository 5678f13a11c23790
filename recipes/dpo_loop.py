"""`run_dpo(recipe)`: DPO on preference pairs. No rollout engine, reward service or
weight broadcast: only the learner group.

The reference model's summed logprobs of every (prompt, chosen) and (prompt,
rejected) are computed once, sharded over the learner ranks, cached on disk keyed by
the data file, tokenizer, reference weights, max length and template, and reused by
later runs; then the reference leaves memory. `dpo.precompute_ref_logprobs: false`
keeps the reference in the loop instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import ray
import torch
from tqdm import tqdm

from posttrain.common.model_registry import cache_dir, resolve_model_path
from posttrain.common.process import default_threads, quiet_libraries
from posttrain.common.telemetry import idle_fraction
from posttrain.learner.batch import TrainBatch, concat, pack_rows
from posttrain.recipes import controller as c
from posttrain.recipes.monitor import StepLog
from posttrain.recipes.placement import place, release
from posttrain.recipes.preference import PreferencePair, TokenizedPair, tokenize_pairs
from posttrain.config import Recipe

TEMPLATE_ID = "plain-text-v1"  # prompt + reply + EOS, no chat template


def pair_batch(pairs: list[TokenizedPair | None], pad_id: int) -> TrainBatch:
    """Rows 2i / 2i+1 = pair i's chosen / rejected reply after its left-padded prompt.
    A None pair is padding: a copy of a real row with an all-zero response mask."""
    real = next(p for p in pairs if p is not None)
    rows = [(q.prompt_ids, reply) for q in (p or real for p in pairs)
            for reply in (q.chosen_ids, q.rejected_ids)]
    ids, attn, resp, width_p = pack_rows(rows, pad_id)
    for i, p in enumerate(pairs):
        if p is None:
            resp[2 * i:2 * i + 2] = 0.0
    return TrainBatch(ids, attn, resp, width_p)


def _padded(pairs: list[TokenizedPair], multiple: int) -> list[TokenizedPair | None]:
    return list(pairs) + [None] * ((-len(pairs)) % multiple)


def cache_key(recipe: Recipe, model_path: str) -> str:
    """Hash of everything the reference logprobs depend on."""
    h = hashlib.sha256()
    data = recipe.data.train
    for f in [Path(data.path)] + sorted(Path(model_path).glob("*.safetensors")) + sorted(
            p for p in Path(model_path).glob("*") if p.name.startswith(("tokenizer", "chat"))):
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
        h.update(f.name.encode())
    h.update(json.dumps([data.model_dump(exclude={"path"}), recipe.dpo.max_length,
                         recipe.model.dtype, TEMPLATE_ID]).encode())
    if recipe.model.adapter.type == "qlora":  # the reference is then the NF4 base, whose
        # blocks depend on the learner count (learner.adapters.nf4_block_sizes)
        h.update(f"qlora-nf4-{recipe.resources.learner.gpus}".encode())
    return h.hexdigest()[:24]


def reference_sums(learners: list[Any], pairs: list[TokenizedPair], pad_id: int,
                   chunk: int) -> torch.Tensor:
    """`[2N]` reference summed logprobs of every pair's rows (chosen, rejected, ...)."""
    out = []
    for i in range(0, len(pairs), chunk):
        part = pairs[i:i + chunk]
        batch = pair_batch(_padded(part, len(learners)), pad_id)
        sums = concat(c.on_learners(learners, "sequence_logprob_sums", batch, -1))
        out.append(sums[:2 * len(part)])
    return torch.cat(out)


def load_or_precompute(recipe: Recipe, learners: list[Any], pairs: list[TokenizedPair],
                       pad_id: int, model_path: str, run_dir: Path) -> torch.Tensor:
    """Reference sums from the disk cache, or computed once and cached; frees the
    reference on every rank either way. Records what happened in precompute.json."""
    from safetensors.torch import load_file, save_file

    path = cache_dir() / "dpo_ref" / f"{cache_key(recipe, model_path)}.safetensors"
    t0 = time.time()
    if path.is_file():
        sums, hit = load_file(path)["ref_sums"], True
    else:
        chunk = len(learners) * max(1, recipe.train.micro_batch_size // 2) * 4
        sums, hit = reference_sums(learners, pairs, pad_id, chunk), False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"ref_sums": sums.contiguous()}, tmp)
        tmp.rename(path)
    ray.get([lw.free_reference.remote() for lw in learners])
    info = {"cache_hit": hit, "path": str(path), "pairs": len(pairs), "seconds": time.time() - t0,
            "bytes": path.stat().st_size}
    (run_dir / "precompute.json").write_text(json.dumps(info, indent=1))
    print(f"reference logprobs: {'cache hit' if hit else 'computed'} ({len(pairs)} pairs, "
          f"{info['seconds']:.1f} s) {path}", flush=True)
    return sums


def run_dpo(recipe: Recipe, run_dir: Path, address: str | None,
            pairs: list[PreferencePair]) -> list[dict[str, float]]:
    """Train DPO; metrics to `run_dir/metrics.jsonl`, final policy to `run_dir/final`."""
    from transformers import AutoTokenizer

    quiet_libraries()
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = str(resolve_model_path(recipe.model.path))
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tokenized = tokenize_pairs(pairs, tok, recipe.dpo.max_length)
    c.write_manifest(run_dir, recipe, model_path)
    c.init_ray(recipe, address)
    placement, learners, log, history = None, [], StepLog(run_dir, recipe), []
    try:
        placement = place(recipe.resources, rollout=False)
        threads = recipe.resources.threads_per_worker or default_threads(len(placement.learner))
        learners = c.start_learners(recipe, model_path, placement, threads)
        precompute = recipe.dpo.precompute_ref_logprobs
        ref_all = (load_or_precompute(recipe, learners, tokenized, pad_id, model_path, run_dir)
                   if precompute else None)
        per_step = recipe.train.prompts_per_step
        g = torch.Generator().manual_seed(recipe.data.shuffle_seed)
        order = torch.randperm(len(tokenized), generator=g).tolist()
        for step in tqdm(range(recipe.train.steps), desc=recipe.name,
                         disable=not recipe.monitor.progress):
            t0 = time.time()
            idx = [order[(step * per_step + k) % len(order)] for k in range(per_step)]
            batch = pair_batch(_padded([tokenized[i] for i in idx], len(learners)), pad_id)
            if precompute:
                rows = torch.tensor([2 * i + j for i in idx for j in (0, 1)])
                ref = torch.cat([ref_all[rows], torch.zeros(len(batch) - len(rows))])
            else:
                ref = concat(c.on_learners(learners, "sequence_logprob_sums", batch, step))
            t_ref = time.time()
            world = len(learners)
            shards = ref.chunk(world)
            stats = ray.get([lw.dpo_train_step.remote(batch.shard(r, world), shards[r], per_step,
                                                      step) for r, lw in enumerate(learners)])[0]
            t_end = time.time()
            spans = [s for part in ray.get([lw.drain_spans.remote() for lw in learners])
                     for s in part]
            metrics = {"step": step, **stats, "time/step": t_end - t0,
                       "time/reference": t_ref - t0, "time/train": t_end - t_ref,
                       "tokens": float(batch.attention_mask.sum()),
                       "learner_idle_fraction": idle_fraction(spans, "learner", world, t0, t_end)}
            history.append(metrics)
            log.record(step, metrics, spans)
        if recipe.train.save_final:
            ray.get([lw.save_checkpoint.remote(str(run_dir / "final"), recipe.train.steps)
                     for lw in learners])
    finally:
        for lw in learners:
            ray.kill(lw)
        if placement is not None:
            release(placement)
        ray.shutdown()
        log.close()
    return history
