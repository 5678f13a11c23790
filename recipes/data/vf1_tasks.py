"""A verifiers 0.4 (`verifiers.v1`) taskset's tasks as prompts (`rollout.environment:
{type: verifiers, api: v1}`, data `{environment: train}`), read by verifiers itself.

verifiers runs in `rollout.environment.python` (default: posttrain's interpreter), a
subprocess running recipes/episodes/vf1_driver.py, because verifiers 0.4 pins openai<3
and mcp==2.0.0 beside posttrain's. `vf1_items`: the driver's `tasks` (which runs its `check`
first, refusing what posttrain cannot serve, named), each prompt carrying the task's
position and content key (`metadata['vf1']`) so the driver later runs that very task
(recipes/episodes/vf1.py runs the episodes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ...config import RecipeError
from ...config.episodes import VerifiersEnvironment
from .items import PromptItem, check_messages

DRIVER = Path(__file__).resolve().parents[1] / "episodes" / "vf1_driver.py"
#: The driver's exit status when the environment needs what posttrain lacks.
REFUSED = 2


def driver_command(cfg: VerifiersEnvironment, verb: str, limit: int | None = None) -> list[str]:
    """argv running the driver's `verb` (check, tasks, run) on `cfg`'s environment."""
    spec: dict[str, Any] = {
        "taskset": cfg.label,
        "args": cfg.args,
        "harness": cfg.harness,
        "timeout_s": cfg.timeout_s,
        "max_concurrent": cfg.max_concurrent,
        "limit": limit,
    }
    return [cfg.python or sys.executable, str(DRIVER), verb, json.dumps(spec)]


def call_driver(cfg: VerifiersEnvironment, verb: str, where: str, limit: int | None = None) -> str:
    """The driver's standard output for `verb`.

    Raises:
        RecipeError: the interpreter is missing, the driver refused the environment
            (its message: what posttrain lacks), failed, or ran past `cfg.timeout_s`.
    """
    argv = driver_command(cfg, verb, limit)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.timeout_s)
    except FileNotFoundError as e:
        raise RecipeError(
            f"{where}: rollout.environment.python {argv[0]!r} does not exist; give the "
            "interpreter of a venv with verifiers>=0.4"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise RecipeError(
            f"{where}: loading the environment took over timeout_s={cfg.timeout_s:g} s"
        ) from e
    if done.returncode == REFUSED:
        raise RecipeError(f"{where}: {done.stderr.strip()}")
    if done.returncode != 0:
        raise RecipeError(
            f"{where}: verifiers could not load the environment ({argv[0]} exited "
            f"{done.returncode}): {done.stderr.strip()[-1500:]}"
        )
    return done.stdout


def vf1_items(
    cfg: VerifiersEnvironment, split: str, key: str, limit: int | None, data_source: str | None
) -> list[PromptItem]:
    """The prompts of `{environment: train}`: the taskset's first `limit` tasks.

    Raises:
        RecipeError: `split` is eval (a v1 taskset is one stream of tasks), the driver
            refused or failed (see `call_driver`), or a task's prompt is not text or
            chat messages (names the task and key).
    """
    where = f"rollout.environment ({cfg.label}, verifiers v1)"
    if split != "train":
        raise RecipeError(
            f"{key}: {{environment: {split}}}: a verifiers v1 taskset has no eval split; "
            "posttrain reads its tasks as {environment: train} only"
        )
    source = data_source or f"verifiers:{cfg.label}"
    items = []
    for line in call_driver(cfg, "tasks", where, limit).splitlines():
        if line.strip():
            items.append(_item(json.loads(line), key, source, cfg.label))
    if not items:
        raise RecipeError(f"{where}: the taskset has no task ({key})")
    return items


def _item(task: dict[str, Any], key: str, source: str, label: str) -> PromptItem:
    where = f"verifiers v1 taskset {label} task {task['idx']}"
    prompt = task["prompt"]
    if prompt is None:
        raise RecipeError(
            f"{where}: no prompt (the user opens the conversation), which posttrain "
            f"cannot sample from; give each task a prompt ({key})"
        )
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if task.get("system_prompt"):
        messages = [{"role": "system", "content": task["system_prompt"]}, *messages]
    messages = check_messages(messages, where, "prompt")
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    meta = {"data_source": source, "vf1": {"idx": task["idx"], "key": task["key"]}}
    return PromptItem(task["idx"], question, "", meta, messages, where)
