"""Built-in `python` reward: a user function with verl's signature,
`compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`,
imported and called inside the reward service process (never the controller).

Arguments as verl passes them: `data_source` is the item's `metadata.data_source` ('' if
none), `extra_info` the row's `extra_info` column when it has one (verl's RL parquet),
else the item's whole metadata. A dict result must hold a numeric `score`; its other
keys go to `details`. The function runs unsandboxed with the service's rights: it is
trusted user code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..common.numbers import finite32
from .protocol import ScoreItem


def load_function(spec: str) -> Callable[..., Any]:
    """Import 'module:function'.

    Raises:
        ValueError: the module cannot be imported or has no such callable; the message
            names the spec and says to put the module on PYTHONPATH.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"function {spec!r}: cannot import {module_name!r} ({e}); put it on "
            "the reward service's PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"function {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def score_python(fn: Callable[..., Any], item: ScoreItem) -> tuple[float, dict[str, Any]]:
    """Call `fn` verl-style on one item.

    Raises:
        ValueError: the function returned something other than a finite number or a
            dict with a numeric 'score'.
    """
    meta = item.metadata
    extra_info = meta["extra_info"] if "extra_info" in meta else meta
    out = fn(meta.get("data_source") or "", item.response, item.ground_truth, extra_info)
    details: dict[str, Any] = {}
    if isinstance(out, dict):
        details = {k: v for k, v in out.items() if k != "score"}
        out = out.get("score")
    if not finite32(out):
        raise ValueError(
            f"compute_score returned {out!r}; return a finite float (within float32's "
            "range, |x| ≤ 3.4e38) or a dict with a numeric 'score'"
        )
    return float(out), details
