"""The built-in `reasoning_gym` reward: a reasoning-gym dataset scores the answer with
its own `score_answer(answer, entry)` (0 to 1; partial credit where the dataset gives it).

The item's metadata carries `reasoning_gym: {dataset, seed, size, config, index}`
(recipes/sources.py puts it there for `reasoning_gym:` sources); the dataset is made
again from those settings (once per worker process) and its problem `index` is the
entry scored, so what the verifier reads is exactly what the prompt was made from and
nothing but those five values crosses the wire.

Answer: the text inside the response's last `<answer_tag>...</answer_tag>`
(reasoning-gym's `extract_answer`), or the whole response stripped when `answer_tag` is
None. A response without the tag is scored as no answer (None), as reasoning-gym's own
training code does.

Runs in the reward service's bounded worker processes (rewards/bounded.py): a dataset
whose scorer hangs on some answer is cut off at the component's `timeout_s`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from ..common.numbers import finite32

_REF_KEYS = ("dataset", "seed", "size", "config", "index")


@lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def score_reasoning_gym(
    response: str, ref: Any, answer_tag: str | None
) -> tuple[float, dict[str, Any]]:
    """`(score, details)` of one response to the reasoning-gym problem `ref` names.

    Raises:
        ValueError: `ref` is not a reasoning-gym reference (the row came from another
            source), or the dataset's score is not a finite number.
    """
    if not isinstance(ref, dict) or any(k not in ref for k in _REF_KEYS):
        raise ValueError(
            "the item's metadata has no reasoning_gym reference ({dataset, seed, size, "
            "config, index}): this component scores rows of `reasoning_gym:` sources only; "
            "give it sources: [...] naming them"
        )
    from reasoning_gym.utils import extract_answer

    ds = _dataset(
        ref["dataset"], ref["seed"], ref["size"], json.dumps(ref["config"], sort_keys=True)
    )
    entry = ds[ref["index"]]
    answer = extract_answer(response, tag_name=answer_tag) if answer_tag else response.strip()
    score = ds.score_answer(answer, entry)
    if not finite32(score):
        raise ValueError(f"reasoning-gym's {ref['dataset']} scored {score!r}, not a finite number")
    return float(score), {"answer_found": float(answer is not None)}
