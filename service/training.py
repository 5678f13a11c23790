"""One training model of the service: a base model with its own LoRA adapter (or all
its weights, for full fine-tuning), its own AdamW state and its own sampler, in this
process. Several live side by side, one per `create_model`; none shares a tensor
with another, so each changes only by its own updates.

Concurrency: every method runs on the service's one worker thread (`service.futures`),
in the order the requests arrived, so `forward_backward` accumulates gradients until
`optim_step` applies and clears them, as the SDK expects.

Limits (first version): the model runs in the service's process on its CPU, not on
posttrain's Ray learner and vLLM engines; sampling uses posttrain's `hf` engine. Weights
and AdamW state are float32; `dtype: bfloat16` computes forward/backward under autocast
(as the recipes' learner computes in bf16) and samples in bf16.
LoRA covers the attention and MLP projections; `train_unembed` is not honoured.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..actors.hf_engine import HFEngine
from ..actors.rollout import SamplingSettings
from ..algorithms.common import token_logprobs
from .errors import UserError
from .losses import check_loss, tinker_loss
from .wire import WireDatum

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelSpec:
    """What `create_model` asked for: base model folder, LoRA rank (None: full
    fine-tuning), seed and which projections carry the adapter."""

    base_model: str
    path: Path
    rank: int | None
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    dtype: str = "float32"  # compute dtype: float32, or bfloat16 (autocast; fp32 masters)


@dataclass(frozen=True)
class Adam:
    """`optim_step`'s Adam parameters (the SDK's `AdamParams`); decoupled weight decay;
    `grad_clip_norm` 0 means no clipping."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


class TrainingModel:
    """A trainable model: `forward_backward`, `optim_step`, `snapshot`, `sample`,
    `save_state`, `load_state`."""

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoModelForCausalLM

        self.spec = spec
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_pretrained(str(spec.path), dtype=torch.float32)
        if spec.rank is not None:
            from peft import LoraConfig, get_peft_model

            targets = (ATTN if spec.train_attn else ()) + (MLP if spec.train_mlp else ())
            self.lora = LoraConfig(
                r=spec.rank, lora_alpha=spec.rank, target_modules=list(targets), bias="none"
            )
            model = get_peft_model(model, self.lora)
        self.model = model
        self.vocab = int(model.get_input_embeddings().weight.shape[0])
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0
        self.pending_grads = 0
        self._sampler: HFEngine | None = None
        self._sampler_version: int | None = None

    # --- training -------------------------------------------------------------------

    def check(self, data: list[WireDatum], loss_fn: str, config: dict[str, float]) -> dict:
        """Validate a batch before it is queued; raises `UserError` naming the
        datum and field. Returns the loss config with its defaults."""
        if not data:
            raise UserError("data", "is empty; send at least one datum")
        full: dict[str, float] = {}
        for i, d in enumerate(data):
            full = check_loss(loss_fn, config, set(d.inputs))
            n = d.tokens.size
            if n == 0 or n > self.context:
                raise UserError(
                    f"data[{i}].model_input",
                    f"has {n} tokens; the model takes 1 to {self.context}",
                )
            bad = d.tokens[(d.tokens < 0) | (d.tokens >= self.vocab)]
            if bad.size:
                raise UserError(
                    f"data[{i}].model_input",
                    f"token id {int(bad[0])} is outside the vocabulary [0, {self.vocab})",
                )
            for name in sorted(d.inputs, key=lambda k: (k != "target_tokens", k)):
                arr = d.inputs[name]
                if arr.shape != (n,):
                    raise UserError(
                        f"data[{i}].loss_fn_inputs.{name}",
                        f"shape {list(arr.shape)} must be [{n}], one per model_input token",
                    )
            t = d.inputs["target_tokens"]
            if ((t < 0) | (t >= self.vocab)).any():
                raise UserError(
                    f"data[{i}].loss_fn_inputs.target_tokens",
                    f"token ids must lie in [0, {self.vocab})",
                )
        return full

    def forward_backward(
        self, data: list[WireDatum], loss_fn: str, config: dict[str, float], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-token logprobs of each datum's targets and, unless `forward_only`, the
        gradient of the summed loss, added to what earlier calls accumulated.

        Returns:
            per datum {`logprobs`, `elementwise_loss`}: `[N]` float32; metrics.
        """
        lengths = [d.tokens.size for d in data]
        width = max(lengths)
        ids = torch.zeros(len(data), width, dtype=torch.long)
        mask = torch.zeros(len(data), width)
        names = {k for d in data for k in d.inputs if k != "target_tokens"}
        floats = {k: torch.zeros(len(data), width) for k in names}
        targets = torch.zeros(len(data), width, dtype=torch.long)
        for i, d in enumerate(data):
            n = lengths[i]
            ids[i, :n] = torch.from_numpy(d.tokens)
            mask[i, :n] = 1.0
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            for k in names:
                floats[k][i, :n] = torch.from_numpy(d.inputs[k].astype(np.float32))
        self.model.train(not forward_only)
        bf16 = self.spec.dtype == "bfloat16"
        with (
            torch.set_grad_enabled(not forward_only),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
        ):
            logits = self.model(input_ids=ids, attention_mask=mask.long()).logits
            logprobs = token_logprobs(logits, targets) * mask
            result = tinker_loss(loss_fn, logprobs, floats, mask, config)
            if not forward_only:
                result.loss.backward()
                self.pending_grads += 1
        lp, el = logprobs.detach(), result.elementwise
        outputs = [
            {"logprobs": lp[i, :n].numpy(), "elementwise_loss": el[i, :n].numpy()}
            for i, n in enumerate(lengths)
        ]
        return outputs, result.metrics

    def optim_step(self, adam: Adam) -> dict[str, float]:
        """Apply AdamW with these parameters to the accumulated gradients, then clear
        them. Returns metrics (`grad_norm`, `step`)."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=adam.learning_rate)
        for g in self.optimizer.param_groups:
            g.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending_grads = 0
        return {"grad_norm:mean": norm if np.isfinite(norm) else 0.0}

    def checksum(self) -> str:
        """sha256 of the trainable tensors (adapter or all weights), in order."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().float().numpy().tobytes())
        return h.hexdigest()

    # --- weights for sampling -------------------------------------------------------

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the weights a sampler needs: the peft adapter tensors (LoRA) or
        the full state dict (full fine-tuning)."""
        if self.spec.rank is not None:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model)
        else:
            state = self.model.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}

    def sample(
        self,
        weights: dict[str, torch.Tensor] | None,
        version: int,
        prompt: list[int],
        settings: SamplingSettings,
        stop_ids: list[int] | None,
    ) -> list[tuple[list[int], list[float], str]]:
        """`settings.n` samples of `prompt` from this model's weights as of `weights`
        (None: the base model), each (tokens, per-token logprobs, stop reason)."""
        if self._sampler is None:
            self._sampler = HFEngine(str(self.spec.path), dtype=self.spec.dtype)
        engine = self._sampler
        if self._sampler_version != version:
            if weights is None:
                pass
            elif self.spec.rank is not None:
                engine.load_adapter(weights.items(), self.lora.to_dict(), version)
            else:
                engine.load_weights(weights.items())
            self._sampler_version = version
        default_stops = engine.stop_ids
        if stop_ids is not None:
            engine.stop_ids = stop_ids or [-1]
        try:
            (samples,) = engine.generate([prompt], settings)
        finally:
            engine.stop_ids = default_stops
        return [(s.token_ids, s.logprobs, s.finish_reason) for s in samples]

    # --- training state ---------------------------------------------------------------

    def save_state(self, folder: Path) -> None:
        """Trainable tensors, AdamW state and step count to `folder/state.pt`."""
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "params": [p.detach().clone() for p in self.params],
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "steps": self.steps,
            },
            folder / "state.pt",
        )

    def load_state(self, folder: Path, optimizer: bool) -> None:
        """Restore `save_state`'s tensors (and the AdamW state when `optimizer`).
        Raises UserError('path') when the checkpoint does not fit this model."""
        blob = torch.load(folder / "state.pt", weights_only=True)
        if [p.shape for p in blob["params"]] != [p.shape for p in self.params]:
            raise UserError("path", "checkpoint's tensors do not fit this model")
        with torch.no_grad():
            for p, v in zip(self.params, blob["params"], strict=True):
                p.copy_(v)
        if optimizer and blob["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(self.params)
            self.optimizer.load_state_dict(blob["optimizer"])
            self.steps = blob["steps"]
        self._sampler_version = None
