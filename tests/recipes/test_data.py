"""Training data: jsonl rows are checked before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from posttrain.config import RecipeError
from posttrain.config.data import DataConfig
from posttrain.recipes.data import load_prompts, prompt_stream
from tests.conftest import ROOT


def _cfg(path, **kw):
    return DataConfig.model_validate(
        {"train": {"path": str(path), "prompt_key": "q", "answer_key": "a", **kw}}
    )


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ("42\n", ":1: a row must be a JSON object"),
        ('"text"\n', ":1: a row must be a JSON object"),
        (
            '{"q": "x", "a": "1"}\n{"q": null, "a": "1"}\n',
            ":2: 'q' (data.train.prompt_key) is null",
        ),
        ('{"q": "x", "a": [1]}\n', ":1: 'a' (data.train.answer_key) is [1]"),
        ('{"question": "x", "a": "1"}\n', "row has no key 'q'"),
        ('{"q": "x", "a": "1"\n', ":1: not valid JSON"),
        ("\n\n", "no rows"),
    ],
)
def test_bad_rows_name_file_line_and_key(tmp_path, rows, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(rows)
    with pytest.raises(RecipeError) as e:
        load_prompts(_cfg(f))
    assert needle in str(e.value) and str(f) in str(e.value)


def test_gsm8k_rows_and_delimiter(shared_data):
    items = load_prompts(
        _cfg(
            shared_data / "gsm8k" / "train.jsonl",
            limit=3,
            prompt_key="question",
            answer_key="answer",
        )
    )
    assert len(items) == 3 and items[0].ground_truth == "72"  # "#### 72" in row 0


def test_prompt_stream_covers_every_prompt_each_epoch():
    items = list(range(5))
    stream = prompt_stream(items, 2, seed=0)
    seen = [x for _ in range(5) for x in next(stream)]  # two epochs
    assert sorted(seen) == sorted(items * 2)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "posttrain.recipes.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_validate_reads_rows_and_run_refuses_used_folder(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": null, "answer": "1"}\n')
    r = _cli("validate", "recipes/quickstart_grpo.yaml", "--set", f"data.train={{path: {bad}}}")
    assert r.returncode == 2 and "data.train.prompt_key" in r.stderr
    used = tmp_path / "run"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    r = _cli("run", "recipes/quickstart_grpo.yaml", "--out", str(used))
    assert r.returncode == 2 and "already holds a run" in r.stderr
    r = _cli("validate", "recipes/quickstart_grpo.yaml", "--set", "train.steps=[1")
    assert r.returncode == 2 and "not valid YAML" in r.stderr


def test_gzip_prompts_and_unreadable_files(tmp_path):
    import gzip as gz

    good = tmp_path / "d.jsonl.gz"
    with gz.open(good, "wt") as f:
        f.write('{"q": "x", "a": "1"}\n')
    assert load_prompts(_cfg(good))[0].question == "x"
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text('{"q": "x", "a": "1"}\n')
    with pytest.raises(RecipeError, match="cannot read it as UTF-8 JSON lines \\(gzip\\)"):
        load_prompts(_cfg(fake))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"q": "\xff", "a": "1"}\n')
    with pytest.raises(RecipeError, match="cannot read it as UTF-8"):
        load_prompts(_cfg(latin))


def test_reward_runtime_checks_find_modules_without_importing():
    r = _cli(
        "validate",
        "recipes/quickstart_grpo.yaml",
        "--set",
        'rewards=[{name: x, type: python, function: "no_such_module:f"}]',
    )
    assert r.returncode == 2 and "rewards.0.function: module 'no_such_module'" in r.stderr
    r = _cli(
        "validate",
        "recipes/quickstart_grpo.yaml",
        "--set",
        'rewards=[{name: x, type: python, function: "tests.rewards.user_rewards:exact"}]',
    )
    assert r.returncode == 0, r.stderr


def test_dpo_data_errors_name_real_key_paths():
    r = _cli("validate", "recipes/dpo_hh.yaml", "--set", "data.train.format=xml")
    assert r.returncode == 2 and "- data.train.format:" in r.stderr


def _old_stream(items, per_step, seed):
    """prompt_stream as it was before it could resume (pop from a fresh shuffle)."""
    import random

    rng, order = random.Random(seed), []
    while True:
        batch = []
        while len(batch) < per_step:
            if not order:
                order = list(items)
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


@pytest.mark.parametrize("stop", [3, 5, 4])  # 5 steps × 2 = two epochs of 5: 5 is a boundary
def test_prompt_stream_resumes_where_it_stopped(stop):
    import json

    items = list(range(5))
    straight = prompt_stream(items, 2, seed=3)
    old = _old_stream(items, 2, seed=3)
    want = [next(straight) for _ in range(8)]
    assert want == [next(old) for _ in range(8)]  # the same order as before
    first = prompt_stream(items, 2, seed=3)
    got = [next(first) for _ in range(stop)]
    state = json.loads(json.dumps(first.state()))  # it travels as JSON
    resumed = prompt_stream(items, 2, seed=3, state=state)
    got += [next(resumed) for _ in range(8 - stop)]
    assert got == want
    # every prompt as often as in the straight run (16 draws of 5 prompts)
    flat = [x for b in got for x in b]
    assert [flat.count(i) for i in items] == [[x for b in want for x in b].count(i) for i in items]


def test_epoch_boundary_resume_shows_each_prompt_once_per_epoch():
    items = list(range(6))
    first = prompt_stream(items, 3, seed=0)
    epoch0 = next(first) + next(first)  # exactly one epoch
    resumed = prompt_stream(items, 3, seed=0, state=first.state())
    epoch1 = next(resumed) + next(resumed)
    assert sorted(epoch0) == sorted(epoch1) == items


def test_prompt_stream_refuses_other_data():
    state = prompt_stream(list(range(5)), 2, seed=0).state()
    with pytest.raises(RecipeError, match="same data"):
        prompt_stream(list(range(6)), 2, seed=0, state=state)
