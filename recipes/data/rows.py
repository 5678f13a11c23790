"""Rows of a data file or folder, each with where it came from, in one shape: a dict.

What is read, and how:
- `.jsonl`, `.jsonl.gz`, `.json` (JSON lines, or one JSON list of row objects): Python's
  json, line by line, so an error names the line and every value keeps its own type.
- `.parquet`, `.csv`: Hugging Face `datasets` (`load_dataset("parquet" | "csv",
  data_files=...)`), one file at a time.
- a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`: `load_from_disk`.
- a folder of parquet shards (`train-00000-of-00002.parquet`, verl's `train.parquet` and
  `test.parquet`, `train/part-0.parquet`): grouped by the split word in their names
  (train, test, validation, valid, dev, eval; none: train).

Nothing is downloaded: `HF_DATASETS_OFFLINE=1` is set before `datasets` is imported and
only local builders are called. `datasets` keeps an Arrow copy of a parquet or csv file in
its cache (HF_DATASETS_CACHE) the first time it reads it, as it does for every user.

Labels: `FILE:LINE` for JSON lines, `FILE row N` (1-based) for the rest.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...common.paths import data_path_problem
from ...config import RecipeError

KINDS = (
    ".jsonl, .jsonl.gz, .json, .parquet, .csv, a folder of parquet shards or a folder "
    "written by datasets' save_to_disk"
)
_SPLIT_WORDS = ("train", "test", "validation", "valid", "dev", "eval")
_SPLIT = re.compile(rf"^({'|'.join(_SPLIT_WORDS)})(?:$|[-_.])")


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """`(line number, parsed row)` of a .jsonl or .jsonl.gz file, blank lines skipped.

    Raises:
        RecipeError: unreadable file (not gzip, not UTF-8, I/O) or a line that is not
            JSON; names the file (and line).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecipeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise RecipeError(
            f"{path}: cannot read it as UTF-8 JSON lines"
            f"{' (gzip)' if opener is gzip.open else ''}: {e}"
        ) from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A .json file: one list of rows, else JSON lines."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read it as UTF-8 JSON: {e}") from None
    if not head.startswith("["):
        for lineno, row in jsonl_rows(path):
            yield f"{path}:{lineno}", row
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path} row {i}", row


def hf_datasets() -> Any:
    """The `datasets` module, offline (never downloads), quiet.

    Raises:
        RecipeError: `datasets` is not installed.
    """
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise RecipeError(
            f"reading parquet, csv and save_to_disk data needs Hugging Face datasets ({e}); "
            "pip install datasets"
        ) from None
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def _dataset_rows(ds: Any, label: str) -> Iterator[tuple[str, dict[str, Any]]]:
    n = 0
    for batch in ds.iter(batch_size=512):
        keys = list(batch)
        for j in range(len(batch[keys[0]]) if keys else 0):
            n += 1
            yield f"{label} row {n}", {k: batch[k][j] for k in keys}


def _load(builder: str, file: Path) -> Any:
    ds = hf_datasets()
    try:
        return ds.load_dataset(builder, data_files=[str(file)], split="train")
    except Exception as e:  # datasets and pyarrow raise many kinds; name the file once
        raise RecipeError(f"{file}: cannot read it as {builder}: {type(e).__name__}: {e}") from None


def _pick(splits: list[str], split: str | None, where: str, key: str) -> str:
    if split is not None:
        if split not in splits:
            raise RecipeError(
                f"{where}: has no split {split!r}; its splits are {sorted(splits)} ({key}.split)"
            )
        return split
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise RecipeError(
        f"{where}: holds the splits {sorted(splits)}; pick one with {key}.split: NAME"
    )


def shard_splits(folder: Path) -> dict[str, list[Path]]:
    """The parquet files under `folder` by split: the first split word of their path
    below `folder` (a folder name or the start of a file name), else 'train'."""
    out: dict[str, list[Path]] = {}
    for f in sorted(folder.rglob("*.parquet")):
        words = [m.group(1) for p in f.relative_to(folder).parts if (m := _SPLIT.match(p))]
        out.setdefault(words[0] if words else "train", []).append(f)
    return out


def _folder_rows(folder: Path, split: str | None, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        ds = hf_datasets()
        try:
            data = ds.load_from_disk(str(folder))
        except Exception as e:  # a damaged folder: name it once
            raise RecipeError(f"{folder}: cannot load it with load_from_disk: {e}") from None
        if isinstance(data, ds.DatasetDict):
            name = _pick(list(data), split, str(folder), key)
            yield from _dataset_rows(data[name], f"{folder} (split {name})")
        else:
            yield from _dataset_rows(data, str(folder))
        return
    shards = shard_splits(folder)
    if not shards:
        raise RecipeError(
            f"{key}.path: {folder} is a folder with no parquet files and no save_to_disk "
            f"dataset; give {KINDS}"
        )
    for f in shards[_pick(list(shards), split, str(folder), key)]:
        yield from _dataset_rows(_load("parquet", f), str(f))


def read_rows(
    path: str | Path, split: str | None = None, key: str = "data.train"
) -> Iterator[tuple[str, Any]]:
    """`(label, row)` of every row of a data file or folder, in order (see the module
    docstring for the kinds and labels). Rows are what the file holds: a dict for every
    kind but JSON, whose rows the caller checks. `key`: the data block's key path
    (`data.train`, `eval.prompts`, `data.train.mixture.1`), named in errors.

    Raises:
        RecipeError: a missing path, an unknown kind, an unreadable file or a missing
            split; names the file.
    """
    path = Path(path)
    name = path.name.lower()
    if os.path.lexists(path) and (problem := data_path_problem(path)):  # a FIFO would hang
        raise RecipeError(f"{key}: {problem}")
    if path.is_dir():
        yield from _folder_rows(path, split, key)
    elif not path.exists():
        raise RecipeError(f"{path}: does not exist; give {KINDS}")
    elif name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        for lineno, row in jsonl_rows(path):
            yield f"{path}:{lineno}", row
    elif name.endswith(".json"):
        yield from _json_rows(path)
    elif name.endswith((".parquet", ".csv")):
        builder = "parquet" if name.endswith(".parquet") else "csv"
        yield from _dataset_rows(_load(builder, path), str(path))
    else:
        raise RecipeError(f"{path}: unknown kind of data file; give {KINDS}")


class RowReader:
    """What turns one file's rows into items (`read_items`), one reader per kind of item
    (prompts: layouts.PromptRows; pairs: pairs.PairRows; conversations: chats.ChatRows).
    A reader keeps what it learns from earlier rows (a file's layout, its prompt shape)."""

    def __call__(self, row: dict[str, Any], where: str, n: int) -> Any:
        """Row `where` (a JSON object) as item number `n`; None skips it (counted).

        Raises:
            RecipeError: a bad row; names the file, the row and the key.
        """
        raise NotImplementedError

    def empty(self, path: str | Path, skipped: int) -> RecipeError:
        """The error for a file that gave no item (`skipped` rows skipped)."""
        return RecipeError(f"{path}: holds no rows")

    def finish(self, items: list[Any]) -> list[Any]:
        """The file's items once all are read (a reader may reshape them)."""
        return items


def read_items(
    path: str | Path, split: str | None, key: str, reader: RowReader, limit: int | None
) -> tuple[list[Any], int]:
    """The items of a data file or folder: every row (`read_rows`) handed to `reader`, in
    order, until `limit` items (None or 0: all), then `reader.finish`; with how many rows
    it skipped. The one loop over a file's rows for every kind of item.

    Raises:
        RecipeError: as `read_rows` and `reader`, a row that is not a JSON object (names
            the file and row), or no item at all (`reader.empty`).
    """
    items: list[Any] = []
    skipped = 0
    for where, row in read_rows(path, split, key):
        if not isinstance(row, dict):
            raise RecipeError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        item = reader(row, where, len(items))
        if item is None:
            skipped += 1
            continue
        items.append(item)
        if limit and len(items) >= limit:
            break
    if not items:
        raise reader.empty(path, skipped)
    return reader.finish(items), skipped


def data_files(path: str | Path) -> list[Path]:
    """Every file a data path reads (a folder's files, sorted), for fingerprints."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]
