"""The console of a run starts with posttrain's own lines: the third-party notes known
to be harmless (torchao's lines for the CUDA kernel libraries a machine cannot load,
torch's deprecation of torchao's Enum registrations, Ray's note that the embedded
cluster enabled token authentication: about a dozen lines before the quickstart's
first) are silenced where they are logged, in the driver and in every Ray worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.test_grpo_e2e import _grpo_recipe

REPO = Path(__file__).resolve().parents[2]

STARTUP = """
import sys, time
import ray
from posttrain.recipes.cli.checks import load_or_exit
from posttrain.recipes.roles import init_ray

recipe, model = sys.argv[1], sys.argv[2]
r, _ = load_or_exit(recipe, None)  # as `posttrain run` starts
from transformers import AutoModelForCausalLM  # a built-in model's conversion loads it

AutoModelForCausalLM.from_pretrained(model)
init_ray(r, None, rollout=False)


@ray.remote
def load(path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path)
    print("worker loaded", flush=True)
    return True


assert ray.get(load.remote(model))
time.sleep(2)  # the workers' output reaches the driver's console
ray.shutdown()
print("started")
"""

NOISE = ("Failed to load", "register_constant", "Token authentication", "Skipping import")


def test_a_run_starts_without_known_third_party_noise(tiny_model, tmp_path):
    recipe = _grpo_recipe(tmp_path, tiny_model)
    got = subprocess.run(
        [sys.executable, "-c", STARTUP, str(recipe), str(tiny_model)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = got.stdout + got.stderr
    assert got.returncode == 0, out[-3000:]
    assert "worker loaded" in out and got.stdout.endswith("started\n"), out[-3000:]
    noisy = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert noisy == []
