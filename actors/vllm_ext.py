"""Methods vLLM adds to its worker (`worker_extension_cls`), called through
`collective_rpc`. With `engine: vllm` (the synchronous `LLM`) the rollout actor runs vLLM
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so arguments arrive as the Python
objects passed (a lazy `(name, tensor)` stream), not serialised copies. With
`rollout.vllm.async_engine` (`AsyncLLM`, actors/vllm_async.py) the worker lives in
vLLM's engine-core process and arguments cross it as msgpack, which rebuilds no tensor
it is not told the type of: weights travel as a safetensors file in /dev/shm (the
`*_file` methods), mapped, not copied, on the worker side.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def skip_tied_embedding_gemm(model: torch.nn.Module) -> list[str]:
    """Stop vLLM's CPU backend from rebuilding, on every reload, the oneDNN matmul of an
    input embedding whose weight an `lm_head` shares (tied embeddings); returns the
    embedding modules changed (none on GPUs, or when nothing is tied).

    Why: `UnquantizedEmbeddingMethod.process_weights_after_loading` packs the weight
    into a oneDNN handler for *each* module holding it, the embedding and the tied head
    alike. Only the head's is ever called (a lookup is `F.embedding`; logits go through
    `lm_head`), and for SmolLM2-135M skipping the embedding's repack takes a load from
    0.244 to 0.219 s (docs/benchmarks.md). Safe only where a head has its own handler:
    a model that takes its logits from `embed_tokens` itself (no `ParallelLMHead` tied
    to it) is left alone.
    Idempotent.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    mods = dict(model.named_modules())
    heads = [m for m in mods.values() if isinstance(m, ParallelLMHead)]
    changed = []
    for name, m in mods.items():
        if (
            type(m) is VocabParallelEmbedding
            and type(m.quant_method) is UnquantizedEmbeddingMethod
            and any(h.weight is m.weight for h in heads)
        ):
            if not getattr(m, "_posttrain_no_gemm", False):
                # Per instance: the head's own method (another object) still repacks.
                m.quant_method.process_weights_after_loading = lambda layer: None
                # Drop the stale handler (and its packed copy); an unexpected matmul
                # on this module still computes from its (reloaded) weight.
                m.cpu_linear = torch.nn.functional.linear
                m._posttrain_no_gemm = True
            changed.append(name)
    return changed


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is vLLM's."""

    def posttrain_load_weights(
        self, stream: Iterable[tuple[str, torch.Tensor]], direct: list[str] | None = None
    ) -> list[str]:
        """Load checkpoint-format `(name, tensor)` pairs in place; returns the names
        consumed, in order. With `direct` (the checkpoint's tensor names) and a model
        `DirectLoader` knows (actors/vllm_direct.py), straight into the layers' kernels;
        otherwise through vLLM's `reload_weights` (which handles fused qkv / gate_up
        layouts and the CPU backend's repacking for any model)."""
        model = self.model_runner.get_model()
        if not getattr(self, "_posttrain_tied_checked", False):  # the model never changes
            skip_tied_embedding_gemm(model)
            self._posttrain_tied_checked = True
        if direct is not None:
            loader = self.posttrain_direct_loader(direct)
            if loader is not None:
                return loader.load(stream)
        names: list[str] = []

        def tap():
            for name, t in stream:
                names.append(name)
                yield name, t

        self.model_runner.reload_weights(weights_iterator=tap())
        return names

    def posttrain_direct_loader(self, names: Iterable[str]):
        """The model's `DirectLoader` (built on first use), or None where vLLM's reload
        is needed; `posttrain_direct_why_not` then says why."""
        if not hasattr(self, "_posttrain_direct"):
            from .vllm_direct import DirectLoader

            lora = self.model_runner.vllm_config.lora_config is not None
            tp = self.model_runner.vllm_config.parallel_config.tensor_parallel_size
            self._posttrain_direct, self.posttrain_direct_why_not = DirectLoader.build(
                self.model_runner.get_model(), set(names), lora, tp
            )
        return self._posttrain_direct

    def posttrain_load_weights_file(
        self, path: str, order: list[str], direct: list[str] | None = None
    ) -> list[str]:
        """`posttrain_load_weights` of the tensors in the safetensors file `path`, in
        `order` (the order they were pushed in)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return self.posttrain_load_weights(((n, f.get_tensor(n)) for n in order), direct)

    def posttrain_save_parameters(self, path: str) -> None:
        """Write `posttrain_named_parameters` to the safetensors file `path`."""
        from safetensors.torch import save_file

        params = self.posttrain_named_parameters()
        save_file({n: t.contiguous() for n, t in params.items()}, path)

    def posttrain_seed(self, seed: int) -> None:
        """Seed the global torch generator of this process (CPU sampling draws from it:
        per-request seeds cannot rewind a CPU generator, see actors/vllm_engine.py)."""
        torch.manual_seed(seed)

    def posttrain_named_parameters(self) -> dict[str, torch.Tensor]:
        """The engine's parameters in vLLM's (fused, possibly repacked) layout."""
        return {n: p.detach().clone() for n, p in self.model_runner.get_model().named_parameters()}
