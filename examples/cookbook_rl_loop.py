"""tinker-cookbook's `recipes/rl_loop.py` (tinker-cookbook 0.6.1, pinned) run unchanged
against `posttrain serve`, with exactly two of its calls replaced so it runs offline on
a local model:

1. `datasets.load_dataset("openai/gsm8k", "main")` (a hub download) → the same rows from
   the repository's local GSM8K sample, recipes/datasets/gsm8k/train.jsonl.
2. `model_info.get_recommended_renderer_name(model_name)` (a registry of hub model names
   that raises for a local folder) → "role_colon", the cookbook's generic renderer.

    pip install --target /tmp/cbk --no-deps tinker-cookbook==0.6.1 chz pylatexenc ...
    posttrain serve &      # then export TINKER_BASE_URL / TINKER_API_KEY as it prints
    PYTHONPATH=/tmp/cbk python examples/cookbook_rl_loop.py MODEL_FOLDER \\
        batch_size=2 group_size=4 max_tokens=64 max_steps=3 loss_fn=importance_sampling

The trailing `key=value` pairs are the cookbook Config's fields. Its default loss,
`stable_reinforce`, is not served (see docs/service.md); pass another.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import chz
import datasets
from tinker_cookbook import model_info
from tinker_cookbook.recipes import rl_loop

GSM8K = Path(__file__).resolve().parents[1] / "recipes" / "datasets" / "gsm8k" / "train.jsonl"


def local_gsm8k(*_args: object, **_kwargs: object) -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": datasets.Dataset.from_json(str(GSM8K))})


def main() -> None:
    model, *overrides = sys.argv[1:]
    rl_loop.datasets = SimpleNamespace(load_dataset=local_gsm8k, DatasetDict=datasets.DatasetDict)
    model_info.get_recommended_renderer_name = lambda _name: "role_colon"
    rl_loop.model_info = model_info
    argv = [f"model_name={model}", f"base_url={os.environ['TINKER_BASE_URL']}", *overrides]
    config = chz.entrypoint(rl_loop.Config, argv=argv)
    rl_loop.main(config)


if __name__ == "__main__":
    main()
