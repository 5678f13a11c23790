"""What `posttrain eval TARGET` evaluates: a run folder, a checkpoint, a saved policy,
an adapter folder or a built-in model alias, resolved to a transformers folder.

Kinds (`resolve_target`), tried in this order:

- `alias`: a key of `common.model_registry.KNOWN_ALIASES` (converted once, cached);
  no recipe of its own (`--recipe` is needed).
- `checkpoint`: a folder with `trainer_state.json` and `learner/`
  (RUN_DIR/checkpoints/step_NNNNN); its policy is rebuilt from the DCP shards
  (`materialize`), its recipe is its own `recipe.yaml`.
- `run`: a folder with `recipe.yaml` (a `posttrain run` RUN_DIR): its `final/` policy,
  else its newest complete checkpoint.
- `adapter`: a folder with `adapter_config.json` (PEFT format): its `merged/` folder
  when the run saved one, else the adapter merged into its base
  (`base_model_name_or_path`) by `materialize` (always, for a DPO evaluation).
- `policy`: a folder with `config.json` and `*.safetensors`.

A policy or adapter folder inside a run folder (RUN_DIR/final) takes the run's recipe.
`head` is 'score' for a reward model (a `*ForSequenceClassification` config, or a
SEQ_CLS adapter), else 'lm'.

Limits: a checkpoint of an adapter run is not rebuilt (evaluate RUN_DIR/final, which
the run saves); conversion holds the whole model in memory once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from ...common.model_registry import KNOWN_ALIASES, resolve_model_path
from ...config import RecipeError

Kind = Literal["alias", "checkpoint", "run", "adapter", "policy"]
KINDS_HELP = (
    "a run folder (runs/NAME-TIME), a checkpoint (RUN_DIR/checkpoints/step_NNNNN), a saved "
    "policy (RUN_DIR/final), an adapter folder (adapter_config.json) or the model alias "
    + ", ".join(KNOWN_ALIASES)
)


@dataclass(frozen=True)
class Target:
    """A resolved TARGET.

    Attributes:
        kind: see the module docstring.
        given: the TARGET as typed.
        folder: the folder evaluated (`final/`, the checkpoint, the adapter, ...); for an
            alias its converted model folder.
        model: a transformers folder of the policy, or None until `materialize` builds
            it (a checkpoint, an adapter without `merged/`).
        recipe: the recipe the target was trained with, if known.
        head: 'score' (a reward model) or 'lm'.
        base: the base model folder of an adapter (else None).
    """

    kind: Kind
    given: str
    folder: Path
    model: Path | None
    recipe: Path | None
    head: Literal["lm", "score"] = "lm"
    base: Path | None = None


def resolve_target(given: str) -> Target:
    """The kind, model folder and recipe of `given` (see the module docstring).

    Raises:
        RecipeError: the path does not exist or is none of the kinds; the message names
            the path, what it lacks and what to give instead.
    """
    if given in KNOWN_ALIASES:
        try:
            folder = resolve_model_path(given)
        except FileNotFoundError as e:
            raise RecipeError(f"TARGET {given}: {e}") from None
        return Target("alias", given, folder, folder, None, _head(folder))
    path = Path(given).expanduser()
    if not path.exists():
        raise RecipeError(f"TARGET {given}: no such file or folder; give {KINDS_HELP}")
    if not path.is_dir():
        raise RecipeError(f"TARGET {given}: is a file, not a folder; give {KINDS_HELP}")
    if (path / "trainer_state.json").is_file() and (path / "learner").is_dir():
        return Target("checkpoint", given, path, None, _file(path / "recipe.yaml"))
    if (path / "recipe.yaml").is_file():
        return _run(given, path)
    return _saved(given, path, _file(path.parent / "recipe.yaml"))


def _file(p: Path) -> Path | None:
    return p if p.is_file() else None


def _run(given: str, run_dir: Path) -> Target:
    """A run folder's final policy, else its newest complete checkpoint."""
    from .. import checkpoints

    recipe = run_dir / "recipe.yaml"
    if (run_dir / "final").is_dir():
        return replace(_saved(given, run_dir / "final", recipe), kind="run")
    last = checkpoints.latest(run_dir)
    if last is None:
        raise RecipeError(
            f"TARGET {given}: the run folder has neither a final policy ({run_dir / 'final'}, "
            "saved when a run ends with train.save_final) nor a complete checkpoint "
            f"({run_dir / checkpoints.FOLDER}); let the run finish, or give another TARGET"
        )
    return Target("run", given, last, None, recipe)


def _saved(given: str, path: Path, recipe: Path | None) -> Target:
    """A PEFT adapter folder or a transformers model folder."""
    if (path / "adapter_config.json").is_file():
        cfg = json.loads((path / "adapter_config.json").read_text())
        head = "score" if cfg.get("task_type") == "SEQ_CLS" else "lm"
        merged = path / "merged"
        model = merged if (merged / "config.json").is_file() else None
        base = cfg.get("base_model_name_or_path")
        if model is None and not (base and (Path(base) / "config.json").is_file()):
            raise RecipeError(
                f"TARGET {given}: an adapter folder whose base model {base!r} "
                "(adapter_config.json: base_model_name_or_path) is not a model folder here, "
                "and no merged/ folder beside it; set base_model_name_or_path to the base "
                "model's folder"
            )
        return Target("adapter", given, path, model, recipe, head, Path(base) if base else None)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return Target("policy", given, path, path, recipe, _head(path))
    missing = "config.json" if not (path / "config.json").is_file() else "*.safetensors weights"
    raise RecipeError(
        f"TARGET {given}: the folder has no recipe.yaml, trainer_state.json, "
        f"adapter_config.json or {missing}, so it is none of the kinds posttrain eval "
        f"reads; give {KINDS_HELP}"
    )


def _head(folder: Path) -> Literal["lm", "score"]:
    """'score' for a sequence-classification config, else 'lm'."""
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "lm"
    return "score" if any(a.endswith("ForSequenceClassification") for a in archs) else "lm"


def materialize(target: Target, work: Path, base_model: str | None = None) -> Target:
    """`target` with `model` set: an adapter merged into its base, or a checkpoint's
    policy rebuilt from its DCP shards on `base_model` (the recipe's resolved
    `model.path`), saved under `work` with the base's tokenizer files.

    Raises:
        RecipeError: a checkpoint without `base_model`, or of an adapter run.
    """
    if target.model is not None:
        return target
    work.mkdir(parents=True, exist_ok=True)
    if target.base is not None:  # an adapter folder, or a run whose final/ is one
        return replace(target, model=_merge_adapter(target, work / "merged"))
    if base_model is None:
        raise RecipeError(f"TARGET {target.given}: a checkpoint needs its recipe's model.path")
    out = work / "policy"
    _rebuild_checkpoint(target, Path(base_model), out)
    return replace(target, model=out, head=_head(out))


def _merge_adapter(target: Target, out: Path) -> Path:
    """The adapter merged into its base model (float32), saved to `out`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ...learner.export import carry_model_files

    assert target.base is not None  # _saved checked it
    cls = AutoModelForSequenceClassification if target.head == "score" else AutoModelForCausalLM
    extra = {"num_labels": 1} if target.head == "score" else {}
    base = cls.from_pretrained(target.base, dtype=torch.float32, **extra)
    merged = PeftModel.from_pretrained(base, target.folder).merge_and_unload()
    merged.save_pretrained(out)
    carry_model_files(str(target.base), out)
    return out


def _rebuild_checkpoint(target: Target, base: Path, out: Path) -> None:
    """The policy of a checkpoint's DCP shards on `base`'s architecture, saved to `out`."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from ...learner.export import carry_model_files

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(target.folder / "learner" / "sharded"), f"{tmp}/state.pt")
        state = _policy_weights(torch.load(f"{tmp}/state.pt", weights_only=False))
    if any(k.startswith("base_model.") for k in state):
        raise RecipeError(
            f"TARGET {target.given}: a checkpoint of an adapter run; evaluate the run's "
            "final/ folder (its adapter) instead"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RecipeError(
            f"TARGET {target.given}: the checkpoint's policy does not fit {base} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); give the recipe it "
            "was trained with (--recipe)"
        )
    model.tie_weights()
    model.save_pretrained(out)
    carry_model_files(str(base), out)


def _policy_weights(state: dict) -> dict:
    """The policy's weights of a loaded training state: `state["policy"]["model"]`, or
    its flattened keys `policy.model.NAME` (learner/checkpoint.py `save_state`)."""
    if isinstance(state.get("policy"), dict):
        return state["policy"]["model"]
    prefix = "policy.model."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
