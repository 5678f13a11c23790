"""`engine: hf` — a transformers model sampling with `generate`, for machines where
vLLM is not installed (and as the reference implementation of the engine interface).

Sampling: the model's `generation_config.json` is set aside at load. transformers'
`generate` fills every field of the config it is passed that is unset from
`model.generation_config` (a repetition penalty, top_k, min_p, typical_p,
no_repeat_ngram_size, bad words...), so the engine replaces that with an empty
`GenerationConfig` and passes every sampling field explicitly: only temperature and
top-p (from the recipe) shape the distribution its logprobs describe.

Limits: no continuous batching or paged KV cache, so long or very uneven responses
waste compute on padding; prompts are sampled in chunks of `max_batch_rows` rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from .adapter_slots import AdapterSlots
from .engine import InferenceEngine, Sample, check_sampling, stop_token_ids
from .hf_adapters import HFNamedAdapters
from .rollout import SamplingSettings

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _Interrupt(event: threading.Event) -> Any:
    """A `generate` stopping criterion: every row stops once `event` is set (checked
    after each token)."""
    from transformers import StoppingCriteria

    class Interrupt(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            return torch.full(
                (input_ids.shape[0],), event.is_set(), dtype=torch.bool, device=input_ids.device
            )

    return Interrupt()


class HFEngine(HFNamedAdapters, InferenceEngine):
    """Batched sampling with `transformers.generate`; logprobs recomputed from the raw
    logits it returns, under the sampling temperature. Serves named LoRA adapters too
    (actors/hf_adapters.py).

    Args:
        device: 'cpu', or 'cuda' (the GPU Ray assigned the actor, `cuda:0` in it).
        max_adapters: named LoRA adapters held at once (least recently used evicted).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "bfloat16",
        max_batch_rows: int = 64,
        device: str = "cpu",
        max_adapters: int = 1,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        self.model.to(self.device).eval()
        self.max_batch_rows = max_batch_rows
        self.adapter_version: int | None = None  # the policy_version of the loaded adapter
        self.slots = AdapterSlots(max_adapters)  # named adapters (actors/hf_adapters.py)
        self.context_tokens = getattr(self.model.config, "max_position_embeddings", None)
        self.stop_ids = stop_token_ids(self.tokenizer, model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        # `generate` merges this into the config it is passed: keep nothing of the file.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id
        )

    @torch.no_grad()
    def _sample_rows(
        self,
        rows: list[list[int]],
        sampling: SamplingSettings,
        interrupt: threading.Event | None = None,
    ) -> list[Sample]:
        from transformers import GenerationConfig, StoppingCriteriaList

        width = max(len(r) for r in rows)
        ends = self.stop_ids + [t for t in sampling.stop_token_ids if t not in self.stop_ids]
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            # The other processors at their neutral values; those without one (min_p,
            # bad words, suppressed tokens) stay unset, and the empty
            # `model.generation_config` has nothing to fill them with.
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_length=0,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=ends,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if sampling.stop:
            config.stop_strings = list(sampling.stop)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            tokenizer=self.tokenizer if sampling.stop else None,
            stopping_criteria=StoppingCriteriaList([_Interrupt(interrupt)] if interrupt else []),
        )
        cut = interrupt is not None and interrupt.is_set()
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() / sampling.temperature  # [N, R, V]
        logprobs = logits.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        samples = []
        for i in range(len(rows)):
            tokens = new[i].tolist()
            end = next((j for j, t in enumerate(tokens) if t in ends), None)
            if sampling.stop:
                hit = self._stop_string_end(tokens[: None if end is None else end], sampling.stop)
                end = hit if hit is not None else end
            length = len(tokens) if end is None else end + 1
            samples.append(
                Sample(
                    token_ids=tokens[:length],
                    logprobs=logprobs[i, :length].tolist(),
                    finish_reason="length" if end is None else "stop",
                    interrupted=cut and end is None and length < sampling.max_new_tokens,
                )
            )
        return samples

    def _stop_string_end(self, tokens: list[int], stop: tuple[str, ...]) -> int | None:
        """Index of the token that completes the first stop string, or None."""
        for j in range(len(tokens)):
            text = self.tokenizer.decode(tokens[: j + 1], skip_special_tokens=True)
            if any(s in text for s in stop):
                return j
        return None

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sample]]:
        return self._generate(prompts, sampling, None)

    def generate_interruptible(
        self, prompts: list[list[int]], sampling: SamplingSettings, interrupt: threading.Event
    ) -> list[list[Sample]]:
        """Stops between tokens once `interrupt` is set (a stopping criterion `generate`
        checks after each token); chunks of rows not started by then come back empty
        and interrupted."""
        return self._generate(prompts, sampling, interrupt)

    def _generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        interrupt: threading.Event | None,
    ) -> list[list[Sample]]:
        check_sampling(sampling)
        torch.manual_seed(sampling.seed)
        rows = [p for p in prompts for _ in range(sampling.n)]
        flat: list[Sample] = []
        for i in range(0, len(rows), self.max_batch_rows):
            chunk = rows[i : i + self.max_batch_rows]
            if interrupt is not None and interrupt.is_set():
                flat.extend(Sample([], [], "length", interrupted=True) for _ in chunk)
            else:
                flat.extend(self._sample_rows(chunk, sampling, interrupt))
        return [flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    @torch.no_grad()
    def load_adapter(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: dict, version: int
    ) -> list[str]:
        """Wrap the model with peft on the first adapter, then swap adapter tensors in
        place (`set_peft_model_state_dict`); the base weights stay as loaded."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        tensors = {n: t.detach().clone() for n, t in weights}
        if not hasattr(self.model, "peft_config"):
            fields = LoraConfig.__dataclass_fields__
            cfg = LoraConfig(**{k: v for k, v in config.items() if k in fields})
            cfg.inference_mode = True
            self.model = get_peft_model(self.model, cfg).eval()
        result = set_peft_model_state_dict(self.model, tensors)
        if result.unexpected_keys:
            raise ValueError(
                f"adapter tensors {result.unexpected_keys[:5]} do not fit the rollout model"
            )
        self.adapter_version = version
        return list(tensors)

    def held_tensors(self, names: Iterable[str], adapter: bool) -> dict[str, torch.Tensor]:
        if adapter:
            from peft import get_peft_model_state_dict

            held = get_peft_model_state_dict(self.model)
        else:
            held = self.model.state_dict()
        return {n: held[n] for n in names if n in held}

    def active_adapter(self) -> int | None:
        """peft's adapter layers are on (not `disable_adapter_layers`) and one is active."""
        if not hasattr(self.model, "peft_config") or not self.model.active_adapters:
            return None
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        if not layers or any(m.disable_adapters for m in layers):
            return None
        return self.adapter_version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> list[str]:
        own = self.model.state_dict()
        loaded: list[str] = []
        for name, tensor in weights:
            if name not in own:
                raise ValueError(f"weight {name!r} is not a parameter of the rollout model")
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r}: shape {tuple(tensor.shape)} does not match the rollout "
                    f"model's {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
            loaded.append(name)
        # Tied weights share storage: a parameter counts as updated if any alias was sent.
        sent = {own[n].data_ptr() for n in loaded}
        stale = [n for n, t in own.items() if t.data_ptr() not in sent]
        if stale:
            raise ValueError(f"weights not sent, the engine would keep old values: {stale[:5]}")
        return loaded
