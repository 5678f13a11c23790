"""Every bench/ script's `--smoke` mode runs to the end and prints its header and table,
so a bench cannot rot unnoticed (STYLE.md, house habits). Each bench runs as its own
process, as a user runs it; the numbers of a smoke run mean nothing and are not checked.

The default run keeps about 55 s on 2 cores (one smoke of each kind: a recipe run in
process (vs_trl), spawned learner ranks (learner), a vLLM engine pushed into
(weight_load), the push path). `slow` (run with `-m slow`): rewards and episodes (13 and
10 s; tests/rewards and tests/test_hub_envs_e2e.py drive the same service and adapters),
dpo (28 s; vs_trl runs a recipe in process and TRL beside it), learner_layout and plan
(17 and 21 s; learner spawns the same ranks, tests/recipes check the planner's
arithmetic), logprobs (17 s; tests/learner check its chunked heads); the smokes that run
the training loop 2 or 3 times, 33-55 s each at load 3 and up to about a minute under
heavier load: adapters (3 CLI runs), token_budget, ratio, old_logprobs and sft (2 runs
each), learning (2 recipes, each trained and evaluated twice), async (4 sim runs and one
run resumed twice: 300 s at load 8); compile (27 s: tests/learner's compiled-layers test
covers its path) and serve (30 s: tests/service_roles drive the same sessions); and the
two that start several vLLM engines (rollout: 3 engines, 52 s; weight_sync: 42 s), whose
engine paths the actors/ and weightsync/ tests cover. `vllm`: starts vLLM engines,
skipped without vLLM.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import vllm_installed

ROOT = Path(__file__).resolve().parents[2]
requires_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
vllm = [pytest.mark.vllm, requires_vllm]
slow = [pytest.mark.slow]
slow_vllm = [*vllm, *slow]

#: bench name -> (marks, lines its output must hold besides the header)
BENCHES: dict[str, tuple[list[pytest.MarkDecorator], list[str]]] = {
    "adapters": (slow, ["| mode | trainable params |", "| QLoRA r16 |"]),
    "async": (slow, ["| setup | k | steps | steps/s |", "| sim 2:1, ", "| continued |"]),
    "compile": (slow, ["| variant | first call s (CPU s) |", "| compiled layers |"]),
    "dpo": (slow, ["step s  tokens/s vs in-loop", "reference in the loop"]),
    "episodes": (
        slow,
        [
            "| environment | ms per episode (median) |",
            "| openenv, websocket |",
            "| verifiers v1 (stand-in) |",
        ],
    ),
    "learning": (slow, ["| recipe | metric | before | after | change (95% CI) |", "| rm_hh |"]),
    "learner": ([], ["| workload | layout | s/step |", "| dpo | 2 rank(s) x 1 thread(s) |"]),
    "learner_layout": (slow, ["| layout | s/step | vs first |", "| 2 ranks x 1 thread |"]),
    "logprobs": (slow, ["| logprobs | train fwd+bwd s (CPU s) |", "| chunked (4) |"]),
    "old_logprobs": (slow, ["| old_logprob_pass | step s |", "| auto |"]),
    "plan": (slow, ["predicted   measured   ratio", "weight push"]),
    "push_path": ([], ["| part (learner rank 0) | seconds | GB/s |", "| gather, shared memory |"]),
    "ratio": (slow, ["rollout:learner  step s vs first", "1:2"]),
    "rewards": (slow, ["measure", "reward model, batch 8, POST /score"]),
    "sft": (slow, ["| system | fixed-batch loss (fp32) |", "| posttrain |"]),
    "rollout": (
        slow_vllm,
        ["| engine | startup s | generate s (median) |", "| vllm async, 4 callers |"],
    ),
    "serve": (slow, ["| SDK round trip (service) |", "| at once |", "| engine 0 |", "| hf |"]),
    "token_budget": (slow, ["| micro-batches | train s | step s |", "| budget 64 tokens |"]),
    "vs_trl": ([], ["| system | s/step (median) |", "| posttrain ("]),
    "weight_load": (
        vllm,
        [
            "| part | seconds | GB/s | vs memcpy |",
            "| VLLMEngine.load_weights, direct load (default) |",
            "| VLLMEngine.load_weights, vLLM's reload_weights |",
        ],
    ),
    "weight_sync": (
        slow_vllm,
        ["| transport | into | push | seconds |", "| collective | vLLM | delta |"],
    ),
}
HEADER = ("# command: python bench/", "# commit: ", "# CPU: ", "# load average")


def _env() -> dict[str, str]:
    """This process's environment with PYTHONPATH made absolute (Ray workers and
    subprocesses may start elsewhere)."""
    paths = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=marks) for name, (marks, _) in BENCHES.items()]
)
def test_smoke_mode_runs_and_prints_its_table(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"bench/{name}.py --smoke exited {proc.returncode}:\n" + (
        out[-3000:] + proc.stderr[-5000:]
    )
    expected = [*HEADER, *BENCHES[name][1]]
    if name in ("vs_trl", "sft") and not (ROOT / ".bench-venv" / "trl" / "bin" / "python").exists():
        expected.append("TRL side skipped: ")  # says so instead of installing TRL
    for line in expected:
        assert line in out, f"bench/{name}.py --smoke printed no {line!r}:\n{out[-3000:]}"


def test_every_bench_has_a_smoke_test() -> None:
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(BENCHES)


def _absolute_paths(source: str) -> list[str]:
    """String constants outside docstrings that are absolute paths to a machine's own
    folders (a bench must find its data from the repo, on any clone)."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and node.value.startswith(("/work/", "/home/", "/root/"))
    ]


def test_no_bench_reads_an_absolute_path() -> None:
    """bench/vs_trl.py once read GSM8K from /work/shared/data: now ../shared beside the
    repo, else the recipe's shipped sample."""
    assert _absolute_paths('"""Doc /work/x."""\nA = "/work/shared/a"\nB = "/dev/shm"\n') == [
        "/work/shared/a"
    ]
    found = {
        p.name: _absolute_paths(p.read_text())
        for p in sorted((ROOT / "bench").glob("*.py"))
        if _absolute_paths(p.read_text())
    }
    assert found == {}
