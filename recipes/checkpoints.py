"""Training checkpoints of a run, controller side: writing them atomically, finding the
newest complete one, and what a resumed recipe may change.

`RUN_DIR/checkpoints/step_NNNNN/` (NNNNN = steps done = the policy_version it holds):

- `learner/`: the learner group's training state (`LearnerWorker.save_checkpoint(path,
  step, kind="state")`: policy, critic and their optimizers sharded by DCP, LR schedule,
  each rank's RNGs);
- `controller_rng.pt`: the controller's torch, python `random` and numpy RNGs;
- `recipe.yaml`: the recipe the checkpoint was made with;
- `trainer_state.json`: the step, the policy_version, the prompt stream's position
  (`recipes.data.PromptStream.state`), the algorithm's own state (DPO: its
  reference cache key; its pair order is a seeded permutation, so the step suffices)
  and the training data's fingerprint (`data_fingerprint`: its rows as loaded, so a
  resume on other data is refused instead of continuing at a position in it);
- `manifest.json`, written last: every other file's size and sha256 (`verify` checks
  them before a resume starts anything, so a truncated or altered file is named, not
  met as a traceback inside a learner's set-up).

A checkpoint is written into `.tmp-step_NNNNN` and renamed when complete, so a folder
named `step_NNNNN` is always whole when written; a partial one is never loaded, and
damage after that (a full disk, a copy cut short, a bad block) is what the manifest
finds. The oldest beyond `train.keep_checkpoints` are removed.

Cost: the manifest reads every file back once after a save and once per resume
(sha256 on up to 8 threads; a few seconds per GB on a shared file system).

Not thread-safe: the controller's thread alone writes, between steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import Recipe, RecipeError
from .loading import dump_recipe
from .state import Run

if TYPE_CHECKING:
    from .algo.base import Algorithm

FOLDER, STATE_FILE, MANIFEST = "checkpoints", "trainer_state.json", "manifest.json"
_NAME = re.compile(r"step_(\d{5,})")

# What a resume may not change (the samples, batches or model it continues), and what it
# may (how long, where to watch, how many learner ranks); any other change is refused too.
FIXED = ("model.path", "algorithm", "rollout.samples_per_prompt", "train.prompts_per_step", "data")
MAY_CHANGE = (
    "train.steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.max_restarts",
    "train.max_empty_steps",
    "monitor",
    "resources.learner.gpus",
    "resources.threads_per_worker",
    "weight_sync.timeout_s",
)


def complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    folder = Path(run_dir) / FOLDER
    found = (
        [p for p in folder.glob("step_*") if _NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
        if folder.is_dir()
        else []
    )
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of `run_dir`, or None."""
    found = complete(run_dir)
    return found[-1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """`trainer_state.json` of a checkpoint: step, policy_version, data, algorithm."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def save_run(run: Run, algo: Algorithm, steps_done: int) -> Path:
    """`save` of a running `Run` (recipes/state.py) after `steps_done` steps: its learners,
    data position, algorithm state and data fingerprint; returns the folder."""
    return save(
        run.run_dir,
        run.recipe,
        run.roles.learners,
        steps_done,
        run.prompts.state() if run.prompts else None,
        algo.checkpoint_state(),
        data_fingerprint(run.data),
    )


def save(
    run_dir: Path,
    recipe: Recipe,
    learners: list[Any],
    steps_done: int,
    data_state: dict[str, Any] | None,
    algo_state: dict[str, Any],
    data: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint after `steps_done` steps (see the module docstring) and
    remove the oldest beyond `train.keep_checkpoints`; returns its folder. The state
    file records the save's wall time (`seconds`, for `posttrain status --advise`) and
    `data`, the training data's `data_fingerprint`.

    Raises:
        CheckpointFailed: a file could not be written (e.g. the disk is full); the
            partial checkpoint is removed, the previous ones are kept.
    """
    import time

    t0 = time.time()
    root = Path(run_dir) / FOLDER
    final, tmp = root / f"step_{steps_done:05d}", root / f".tmp-step_{steps_done:05d}"
    try:
        _write(tmp, recipe, learners, steps_done, data_state, algo_state, data, t0)
    except OSError as e:  # a learner's own OSError comes back as a RayTaskError that is one
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointFailed(run_dir, final, e) from e
    if final.exists():  # the same step again (a resume that stopped at once)
        shutil.rmtree(final)
    tmp.rename(final)
    for old in complete(run_dir)[: -recipe.train.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a folder no longer writable); its
    partial files are removed and the previous checkpoint is kept. The message names the
    folder, the OS's reason and how to resume."""

    def __init__(self, run_dir: Path, folder: Path, error: OSError):
        cause = getattr(error, "cause", None) or error  # a learner's, through Ray
        reason = getattr(cause, "strerror", None) or str(cause).splitlines()[-1]
        before = [p.name for p in complete(run_dir) if p != folder]
        kept = f"the previous checkpoint {before[-1]} is kept" if before else "no checkpoint yet"
        super().__init__(
            f"checkpoint {folder} could not be written ({reason}); {kept}. Free space "
            f"there (or lower train.keep_checkpoints), then resume with: posttrain run "
            f"--resume {run_dir}"
        )


def _write(
    tmp: Path,
    recipe: Recipe,
    learners: list[Any],
    steps_done: int,
    data_state: dict[str, Any] | None,
    algo_state: dict[str, Any],
    data: dict[str, Any] | None,
    t0: float,
) -> None:
    """The checkpoint's files in `tmp` (`save` renames it once whole)."""
    import time

    import ray

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray.get(
        [lw.save_checkpoint.remote(str(tmp / "learner"), steps_done, "state") for lw in learners]
    )
    torch.save(
        {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        tmp / "controller_rng.pt",
    )
    (tmp / "recipe.yaml").write_text(dump_recipe(recipe))
    (tmp / STATE_FILE).write_text(
        json.dumps(
            {
                "step": steps_done,
                "policy_version": steps_done,
                "data": data_state,
                "algorithm": algo_state,
                "data_fingerprint": data,
                "seconds": time.time() - t0,
            }
        )
    )
    write_manifest(tmp)


_fingerprint: tuple[Any, dict[str, Any]] | None = None  # (the data, its fingerprint)


def data_fingerprint(data: list[Any]) -> dict[str, Any]:
    """{"rows", "sha256"} of the training data as loaded (prompts or preference pairs,
    in order): sha256 of each row's JSON (sorted keys, without `origin`, the row's
    file and line), one a line. Any change of what the prompt stream's position points
    into (a row edited, added, removed or moved) changes it; the same content from
    another file or path does not. Remembered for the last `data` object (a run saves
    the same list at every checkpoint)."""
    global _fingerprint
    if _fingerprint is not None and _fingerprint[0] is data:
        return _fingerprint[1]
    h = hashlib.sha256()
    for row in data:
        plain = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row
        if isinstance(plain, dict):
            plain = {k: v for k, v in plain.items() if k != "origin"}
        h.update(json.dumps(plain, sort_keys=True, default=str).encode() + b"\n")
    _fingerprint = (data, {"rows": len(data), "sha256": h.hexdigest()})
    return _fingerprint[1]


def data_change(checkpoint: Path, recipe: Recipe, data: list[Any]) -> str | None:
    """How `data` differs from the training data `checkpoint` was made with, naming the
    data file (`data.train.path`, or the generator); None when it is the same, or when
    the checkpoint predates data fingerprints."""
    then = read_state(checkpoint).get("data_fingerprint")
    now = data_fingerprint(data)
    if not then or then["sha256"] == now["sha256"]:
        return None
    d = recipe.data.train
    where = (
        f"data.train.path {d.path}"
        if hasattr(d, "path")
        else f"data.train (generator {getattr(d, 'generator', '?')})"
    )
    return (
        f"{where}: the training data differs from the data checkpoint {Path(checkpoint).name} "
        f"was made with ({then['rows']} rows, sha256 {then['sha256'][:12]}… then; "
        f"{now['rows']} rows, sha256 {now['sha256'][:12]}… now), so its saved data position "
        "would continue in other prompts"
    )


class CheckpointDamaged(RuntimeError):
    """A checkpoint file is missing or differs from its manifest (`verify`).

    Attributes:
        checkpoint: the checkpoint folder.
        file: the damaged file (full path).
    """

    def __init__(self, checkpoint: Path, file: Path, detail: str):
        self.checkpoint, self.file = Path(checkpoint), Path(file)
        super().__init__(f"{file}: {detail}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):  # 1 MiB reads hash without the GIL
            h.update(chunk)
    return h.hexdigest()


def _hash_all(paths: list[Path]) -> list[str]:
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(folder: Path) -> None:
    """Write `folder/manifest.json`: {"files": {relative path: {"bytes", "sha256"}}} of
    every file under `folder` (the manifest itself excepted)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _hash_all(files)
    entries = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": d}
        for p, d in zip(files, digests, strict=True)
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify(checkpoint: Path) -> bool:
    """Check every file the checkpoint's manifest lists: present, of its size, of its
    sha256 (sizes first, so a truncated file is named without hashing the rest).
    Returns True when verified, False for a checkpoint written before manifests
    existed (nothing to check against).

    Raises:
        CheckpointDamaged: a listed file is missing, of another size or content, or the
            manifest itself is unreadable; names the first such file.
    """
    folder = Path(checkpoint)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(folder, manifest, f"unreadable manifest ({e})") from None
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointDamaged(folder, path, "missing (the manifest lists it)")
        if (size := path.stat().st_size) != want["bytes"]:
            raise CheckpointDamaged(
                folder,
                path,
                f"{size} bytes, the manifest recorded {want['bytes']} "
                f"({'truncated' if size < want['bytes'] else 'grown'} since it was written)",
            )
    paths = [folder / name for name in files]
    for path, got, want in zip(paths, _hash_all(paths), files.values(), strict=True):
        if got != want["sha256"]:
            raise CheckpointDamaged(
                folder,
                path,
                f"sha256 {got[:12]}…, the manifest recorded {want['sha256'][:12]}… "
                "(same size, altered content)",
            )
    return True


def whole_before(checkpoint: Path) -> Path | None:
    """The newest complete checkpoint older than `checkpoint` whose files verify (or
    that has no manifest to check), or None."""
    steps = int(Path(checkpoint).name[5:])
    older = [p for p in complete(Path(checkpoint).parent.parent) if int(p.name[5:]) < steps]
    for candidate in reversed(older):
        try:
            verify(candidate)
        except CheckpointDamaged:
            continue
        return candidate
    return None


def restore_controller_rng(checkpoint: Path) -> None:
    """Set this process's torch, python and numpy RNGs to the checkpoint's."""
    rng = torch.load(Path(checkpoint) / "controller_rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resume_changes(saved: Recipe, new: Recipe) -> list[str]:
    """The keys `new` changes from the checkpoint's recipe, as 'key: old → new' lines.

    Raises:
        RecipeError: a change a resume cannot make (FIXED, or anything not in
            MAY_CHANGE); names the key.
    """
    old, cur = _flat(saved.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    changed = sorted(k for k in old.keys() | cur.keys() if old.get(k) != cur.get(k))
    for key in changed:
        if _under(key, FIXED) or not _under(key, MAY_CHANGE):
            why = (
                "it fixes the model, the data or the batches the run continues"
                if _under(key, FIXED)
                else "a resumed run keeps the rest of its recipe so it continues exactly"
            )
            raise RecipeError(
                f"{key}: the checkpoint was made with {old.get(key)!r}, this recipe has "
                f"{cur.get(key)!r}; {why}. Resume with the checkpoint's value (a resume may "
                f"change only {', '.join(MAY_CHANGE)}), or start a new run with --out"
            )
    return [f"{k}: {old.get(k)!r} → {cur.get(k)!r}" for k in changed]
