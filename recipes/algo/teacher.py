"""Checks of on-policy distillation's teacher (`distill.teacher`), run by `posttrain
validate` and `run` before any process starts: the teacher is a built-in alias or a
model folder, its tokenizer equals the student's (the teacher scores the student's
token ids, so one id must mean one string in both) and it has a logit for every id the
student can sample (vocab_size). Only tokenizers are loaded (no
torch import for a folder with tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...common.model_folder import load_tokenizer, model_folder_problem
from ...common.model_registry import readable_model_folder
from ...config import Recipe, RecipeError


def check_teacher_folder(recipe: Recipe) -> None:
    """`distill.teacher` is a built-in alias or a folder with config.json (no-op for a
    recipe without a teacher).

    Raises:
        RecipeError: it is neither; names the key and how users make one.
    """
    from ...common.model_registry import KNOWN_ALIASES

    teacher = recipe.facts.teacher
    if not teacher or teacher in KNOWN_ALIASES:
        return
    if not (Path(teacher).expanduser() / "config.json").is_file():
        raise RecipeError(
            f"distill.teacher: {teacher!r} is neither a built-in alias "
            f"({', '.join(sorted(KNOWN_ALIASES))}) nor a folder with config.json (relative "
            "paths are read from the working directory); give a local model folder, e.g. "
            "the policy a run saved in RUN_DIR/final (posttrain run "
            "recipes/quickstart_grpo.yaml --out runs/quickstart-grpo)"
        )
    if problem := model_folder_problem(Path(teacher).expanduser()):  # truncated weights
        raise RecipeError(f"distill.teacher: {problem}; save or download the teacher again")


def check_teacher_tokenizer(recipe: Recipe, convert: bool = False) -> bool:
    """The teacher's tokenizer equals the student's: the same token → id map.

    Args:
        convert: convert a built-in alias first if it is not yet (`run`); without it an
            unconverted alias skips the check.

    Returns:
        False when the check was skipped (no teacher, or an unconverted alias without
        `convert`), True when it passed.

    Raises:
        RecipeError: the student has more vocabulary rows than the teacher
            (`check_vocab_sizes`), the tokenizers differ (names `distill.teacher`, both
            tokenizers and the first token they disagree on), or one cannot be loaded.
    """
    teacher = recipe.facts.teacher
    if not teacher:
        return False
    check_teacher_folder(recipe)
    student_dir = readable_model_folder(recipe.model.path, convert)
    teacher_dir = readable_model_folder(teacher, convert)
    if student_dir is None or teacher_dir is None:
        return False
    check_vocab_sizes(student_dir, teacher_dir)
    student = _load(student_dir, "model.path")
    taught = _load(teacher_dir, "distill.teacher")
    difference = vocab_difference(student.get_vocab(), taught.get_vocab())
    if difference is not None:
        raise RecipeError(
            f"distill.teacher: the teacher's tokenizer {describe(teacher_dir, taught)} "
            f"differs from the student's (model.path) {describe(student_dir, student)}: "
            f"{difference}. The teacher scores the student's token ids, so both must "
            "share one tokenizer; give a teacher trained from the student's base model "
            "(or the same family), or distill into a student with the teacher's tokenizer"
        )
    return True


def vocab_size(folder: Path) -> int | None:
    """`vocab_size` of a model folder's config.json (or of its `text_config`): the rows
    of its embedding and head; None when the file names none (transformers will name
    the problem when it loads the model)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = cfg.get("vocab_size")
    if n is None and isinstance(cfg.get("text_config"), dict):
        n = cfg["text_config"].get("vocab_size")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def check_vocab_sizes(student: Path, teacher: Path) -> None:
    """The student samples ids below its `vocab_size`, and the teacher scores each one
    with its head: a student with more rows (Qwen2.5-7B's 152064 against a 151936 one)
    samples ids the teacher has no logit for. A larger teacher is fine.

    Raises:
        RecipeError: the student's vocab_size is larger; names both folders and sizes.
    """
    s, t = vocab_size(student), vocab_size(teacher)
    if s is not None and t is not None and s > t:
        raise RecipeError(
            f"distill.teacher: the student (model.path) {student} has vocab_size {s} and "
            f"the teacher {teacher} has {t}; the student can sample ids {t} to {s - 1}, "
            "which the teacher has no logit for. Distill into a student whose vocab_size "
            "is at most the teacher's, or use a teacher with as many rows"
        )


def _load(folder: Path, key: str) -> Any:
    try:
        return load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"{key}: cannot load the tokenizer of {folder} ({e}); give a transformers "
            "folder with its tokenizer files"
        ) from None


def describe(folder: Path, tok: Any) -> str:
    """`folder (TokenizerClass, N tokens)`."""
    return f"{folder} ({type(tok).__name__}, {len(tok.get_vocab())} tokens)"


def vocab_difference(student: dict[str, int], teacher: dict[str, int]) -> str | None:
    """The first token (by the student's id) whose id differs between the two token →
    id maps, or a token only the teacher has, in words; None when the maps are equal."""
    for token, i in sorted(student.items(), key=lambda kv: kv[1]):
        j = teacher.get(token)
        if j != i:
            where = "is missing" if j is None else f"is id {j}"
            return f"token {token!r} is id {i} in the student and {where} in the teacher"
    extra = sorted(set(teacher) - set(student), key=lambda t: teacher[t])
    if extra:
        return (
            f"the teacher has {len(extra)} tokens the student lacks, first {extra[0]!r} "
            f"(id {teacher[extra[0]]})"
        )
    return None
