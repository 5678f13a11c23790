"""A faster weight load for vLLM's CPU backend: checkpoint tensors go straight into the
layers' kernels, without vLLM's layerwise reload.

Why: on CPU every push ends in vLLM's `reload_weights`, which rebuilds each layer from
meta tensors, loads it through the model's weight loaders, repacks it and copies the
result back into the old kernel tensors: for SmolLM2-135M 0.24 s of a 0.46 s push on G,
of which the repacking (oneDNN / AMX handlers, the part no load can skip) is about a
third; the rest is two copies per tensor and Python per layer (docs/benchmarks.md). This
loader keeps, per linear layer, one plain weight in vLLM's fused layout (q, k, v stacked
for `qkv_proj`, gate and up for `gate_up_proj`), copies each pushed tensor into its rows
once, and hands the layer to vLLM's own CPU dispatch (`dispatch_cpu_unquantized_gemm`,
the same function a normal load ends in), so the kernels it builds are the ones a
reload builds from the same bytes. Embeddings and norms are copied in place; a head
tied to the embedding is repacked as soon as the embedding is in.

It is used only where every piece is known: vLLM on CPU, an architecture in
`ARCHITECTURES` (tested against the reload), one tensor-parallel rank, no LoRA, every
linear layer unquantized, every model parameter reached by a checkpoint
name and every checkpoint name reaching a parameter. Otherwise `DirectLoader.build`
returns None and the engine keeps vLLM's reload (weightsync docs: docs/weight-sync.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: Models whose vLLM `load_weights` only copies checkpoint tensors into place (no
#: permutation or scaling), checked bit for bit against vLLM's reload in
#: tests/actors/test_vllm_direct.py. Others keep the reload until tested so.
ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


class DirectLoader:
    """Loads `(checkpoint name, tensor)` pairs into a vLLM model on CPU; see the module
    docstring. Built once per engine by `build` (the model's structure never changes).

    A linear layer is repacked as soon as the last of its parts arrives, so with a
    streamed push layers are repacked while later buckets are still on the wire.
    """

    def __init__(self, model: torch.nn.Module, names: set[str]):
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        packed = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
        #: checkpoint name -> ("part", layer name, "weight"|"bias", row offset, rows)
        #: or ("copy", parameter) or ("head", module)
        self.targets: dict[str, tuple] = {}
        self.layers: dict[str, torch.nn.Module] = {}  # linear layers, by module name
        self.staging: dict[tuple[str, str], torch.Tensor] = {}  # (layer, weight|bias)
        self.parts: dict[str, int] = {}  # how many tensors make up each layer
        self.repack: list[torch.nn.Module] = []  # embedding-type modules with a kernel
        reached: set[int] = set()  # ids of the model's parameters some name reaches
        for mname, m in model.named_modules():
            if isinstance(m, LinearBase):
                self._linear(mname, m, packed)
                reached.update(id(p) for p in m.parameters(recurse=False))
            elif isinstance(m, VocabParallelEmbedding):
                # A head tied to the embedding shares its Parameter: loaded once.
                kind = "head" if isinstance(m, ParallelLMHead) else "copy"
                self.targets[f"{mname}.weight"] = (kind, m) if kind == "head" else (kind, m.weight)
                self.repack.append(m)
                reached.add(id(m.weight))
            else:
                for pname, p in m.named_parameters(recurse=False):
                    self.targets[f"{mname}.{pname}"] = ("copy", p)
                    reached.add(id(p))
        for mname, p in model.named_parameters():
            if id(p) not in reached:
                raise _Unsupported(f"parameter {mname} is reached by no checkpoint name")
        if unknown := sorted(names - set(self.targets)):
            raise _Unsupported(f"checkpoint names {unknown[:3]} reach no parameter")

    def _linear(self, mname: str, m: torch.nn.Module, packed: dict[str, list[str]]) -> None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        if type(m.quant_method) is not UnquantizedLinearMethod:
            raise _Unsupported(f"{mname} is quantized ({type(m.quant_method).__name__})")
        if getattr(m, "tp_size", 1) != 1 or getattr(m, "_cpu_skip_gemm_dispatch", False):
            raise _Unsupported(f"{mname} is sharded or has no CPU kernel")
        if not hasattr(m, "cpu_linear"):
            raise _Unsupported(f"{mname} has no CPU kernel (not dispatched)")
        prefix, leaf = mname.rsplit(".", 1) if "." in mname else ("", mname)
        subs = packed.get(leaf)
        sizes = list(getattr(m, "output_sizes", None) or [m.output_size])
        if subs is not None and len(subs) != len(sizes):
            raise _Unsupported(f"{mname}: {len(subs)} packed parts, {len(sizes)} sizes")
        stems = [f"{prefix}.{s}" if prefix else s for s in subs] if subs else [mname]
        dtype = m.params_dtype
        self.layers[mname] = m
        kinds = ["weight"] + (["bias"] if getattr(m, "bias", None) is not None else [])
        for kind in kinds:
            shape = (sum(sizes), m.input_size) if kind == "weight" else (sum(sizes),)
            self.staging[(mname, kind)] = torch.empty(shape, dtype=dtype)
            offset = 0
            for stem, rows in zip(stems, sizes, strict=True):
                self.targets[f"{stem}.{kind}"] = ("part", mname, kind, offset, rows)
                offset += rows
        self.parts[mname] = len(stems) * len(kinds)

    @classmethod
    def build(cls, model: torch.nn.Module, names: set[str], lora: bool, tp: int):
        """A loader for `model` whose checkpoint holds `names`, or None where vLLM's
        reload must be used (a GPU, tensor parallelism, LoRA, a quantized or unknown
        layer, a name or parameter without a counterpart); `(loader, why_not)`."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None, "not the CPU backend"
        if type(model).__name__ not in ARCHITECTURES:
            return None, f"{type(model).__name__} is not among {sorted(ARCHITECTURES)}"
        if lora or tp != 1:
            return None, "LoRA or tensor parallelism"
        try:
            return cls(model, names), None
        except _Unsupported as e:
            return None, str(e)

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load every pair of `stream`; returns the names consumed, in order.

        Raises:
            ValueError: a name no parameter answers, a tensor of the wrong shape, or a
                layer left with some of its parts missing (the engine is then partly
                loaded: the caller marks it broken, as after a failed reload).
        """
        names: list[str] = []
        got: dict[str, int] = {}
        copied: dict[int, tuple[int, tuple]] = {}  # parameter id -> (source pointer, shape)
        with torch.no_grad():
            for name, t in stream:
                names.append(name)
                target = self.targets.get(name)
                if target is None:
                    raise ValueError(f"weight {name!r} is not a parameter of the rollout model")
                if target[0] == "part":
                    _, mname, kind, offset, rows = target
                    dst = self.staging[(mname, kind)][offset : offset + rows]
                    _copy(name, dst, t)
                    got[mname] = got.get(mname, 0) + 1
                    if got[mname] == self.parts[mname]:
                        self._repack(mname)
                else:
                    param = target[1].weight if target[0] == "head" else target[1]
                    source = (t.data_ptr(), tuple(t.shape))
                    # A tied head arrives as the embedding's tensor once more: loaded.
                    if copied.get(id(param)) != source:
                        _copy_rows(name, param, t)
                        copied[id(param)] = source
                        # Its kernels now (a tied head's too), not at the end of the push.
                        for m in self.repack:
                            if m.weight is param:
                                m.quant_method.process_weights_after_loading(m)
            if short := sorted(m for m, n in self.parts.items() if got.get(m, 0) != n):
                raise ValueError(
                    f"layers {short[:3]} got only some of their tensors; the engine would "
                    "serve half-old weights"
                )
            if stale := [m for m in self.repack if id(m.weight) not in copied]:
                raise ValueError(f"{type(stale[0]).__name__} got no weight in this push")
        return names

    def _repack(self, name: str) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        layer = self.layers[name]
        layer.weight = torch.nn.Parameter(self.staging[(name, "weight")], requires_grad=False)
        if (name, "bias") in self.staging:
            # The dispatch may swap the bias for an fp32 copy; give it the new bf16 one.
            layer.bias.data = self.staging[(name, "bias")]
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)


class _Unsupported(Exception):
    """The model has a piece `DirectLoader` does not know; vLLM's reload is used."""


def _copy(name: str, dst: torch.Tensor, t: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(t.shape)}; the rollout model's is {tuple(dst.shape)}"
        )
    dst.copy_(t)


def _copy_rows(name: str, param: torch.Tensor, t: torch.Tensor) -> None:
    """Copy `t` into `param`; a vocabulary padded beyond the checkpoint's rows keeps
    zeros there (as vLLM's embedding loader leaves them)."""
    if t.ndim == param.ndim and t.ndim == 2 and t.shape[0] < param.shape[0]:
        _copy(name, param.data[: t.shape[0]], t)
        param.data[t.shape[0] :].zero_()
    else:
        _copy(name, param.data, t)
