"""Trainable weights on their way to rollout servers: encoded once, checked by checksum on arrival.

`WeightsUpload.of(state, lora)` encodes the weights (the LoRA's, with its settings so that a server
without the adapter adds the same one, or the full transformer's) as the weight-update body of
flowrl.server.wire, with the checksum of the tensors themselves. `RemoteEngine.push_weights`
uploads it to one server and verifies that the server then serves that version with that checksum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flowrl.server import wire


@dataclass(frozen=True)
class WeightsUpload:
    """body: the safetensors body; sha256: `wire.weights_sha256` of the tensors; kind: "lora" or "full"."""

    body: bytes
    sha256: str
    kind: str

    @classmethod
    def of(
        cls, state: Mapping[str, torch.Tensor], lora: Mapping | None = None, component: str = wire.WEIGHTS_COMPONENT
    ) -> "WeightsUpload":
        """`component`: the checkpoint's module the weights belong to (the adapter's trained_component)."""
        body = wire.encode_weights(state, lora=lora, component=component)
        return cls(body, wire.weights_sha256(state), "lora" if lora else "full")
