"""The recipe's `weight_sync:` block: how new weights reach the rollout engines
(transport, buckets, proof of delivery, deltas, shared-memory paths, adapter pushes)
(pydantic, no ML imports; the transports themselves live in weightsync/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict


class WeightSyncConfig(_Strict):
    type: Literal["object_store", "collective", "filesystem", "cuda_ipc"] = Field(
        "object_store",
        description="Transport of new weights to rollout engines: 'object_store' (Ray's shared "
        "memory), 'collective' (a torch.distributed broadcast from learner rank 0: gloo on CPU, "
        "NCCL on GPUs), 'filesystem' (safetensors files under weight_sync.directory), "
        "'cuda_ipc' (colocated on GPUs: each engine opens the learner's gathered tensors on "
        "their shared GPU through CUDA IPC handles, no copy through the host).",
    )
    bucket_mb: int = Field(
        64, gt=0, description="collective: MiB per broadcast bucket (tensors packed together)."
    )
    directory: str = Field(
        "/dev/shm/posttrain",
        description="filesystem: folder for weight files (each run uses its own subfolder); a "
        "shared filesystem when engines run on other nodes.",
    )
    verify_checksum: bool = Field(
        True,
        description="Proof of delivery after every push: learner rank 0 and every engine "
        "fingerprint each tensor (xxh3 of the engine-dtype bytes; the engine's held tensors on "
        "engine 'hf', the tensors handed to vLLM's loader on engine 'vllm'), and with "
        "adapter_mode 'adapter' each engine shows the pushed adapter is the one its next "
        "request runs with; a difference stops the run naming the engine and the tensor. "
        "Costs one read of the pushed bytes on each side (docs/weight-sync.md); false turns "
        "it off.",
    )
    delta: bool = Field(
        False,
        description="Send only the elements that changed since the previous push (flat "
        "indices + values, per tensor; a tensor whose change is large goes whole, and a push "
        "whose delta exceeds half the full bytes goes full). Engines rebuild bit-exact full "
        "tensors from a copy of the previous push they keep (one extra copy of the weights "
        "on learner rank 0 and on each engine). The first push of a learner process, and "
        "every push after an engine was replaced, is full. Transports: collective, "
        "object_store, filesystem (not cuda_ipc); a delta push is not streamed.",
    )
    shm_gather: bool = Field(
        True,
        description="CPU learners (resources.device: cpu) whose ranks share one machine hand "
        "their FSDP shards of each push to rank 0 through shared memory (/dev/shm) instead of "
        "gloo all-gathers over loopback TCP, which were most of a CPU push "
        "(docs/weight-sync.md). Costs one extra copy of each rank's shard in the engines' "
        "dtype; ranks on several machines, GPUs and adapter pushes always all-gather. false: "
        "always all-gather.",
    )
    shm_broadcast: bool = Field(
        True,
        description="type collective on CPU (gloo): when every engine shares learner rank "
        "0's /dev/shm (one machine; checked when the push group forms), rank 0 packs each "
        "bucket into a /dev/shm file the engines map and only a one-number signal goes "
        "over gloo, instead of every byte through loopback TCP (docs/weight-sync.md). One "
        "copy of the pushed bytes is shared by rank 0 and the engines (files unlinked once "
        "mapped). false: always over gloo.",
    )
    timeout_s: float = Field(
        300.0, gt=0, description="Seconds every engine has to acknowledge a push."
    )
    adapter_mode: Literal["adapter", "merged"] = Field(
        "merged",
        description="With model.adapter: 'merged' pushes full weights (adapter merged into the "
        "base by the learner) through the transport; 'adapter' sends only the adapter tensors "
        "and the engine loads them as a LoRA adapter (plain LoRA only, not DoRA; QLoRA first "
        "sends its dequantised NF4 base once, as policy_version 0).",
    )

    @model_validator(mode="after")
    def _delta_transport(self) -> WeightSyncConfig:
        if self.delta and self.type == "cuda_ipc":
            raise ValueError(
                "weight_sync.delta does not apply to type 'cuda_ipc' (colocated engines open "
                "the learner's tensors in place; nothing is copied to save): set delta: false"
            )
        return self
