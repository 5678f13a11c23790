"""Methods vLLM adds to its worker (`worker_extension_cls`), called through
`LLM.collective_rpc`. The rollout actor runs vLLM in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so arguments arrive as the Python objects
passed (a lazy `(name, tensor)` stream), not serialised copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is vLLM's."""

    def posttrain_load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load checkpoint-format `(name, tensor)` pairs in place through vLLM's
        `reload_weights` (which handles fused qkv / gate_up layouts and the CPU backend's
        repacking); returns the names consumed, in order."""
        names: list[str] = []

        def tap():
            for name, t in stream:
                names.append(name)
                yield name, t

        self.model_runner.reload_weights(weights_iterator=tap())
        return names

    def posttrain_named_parameters(self) -> dict[str, torch.Tensor]:
        """The engine's parameters in vLLM's (fused, possibly repacked) layout."""
        return {n: p.detach().clone() for n, p in self.model_runner.get_model().named_parameters()}
