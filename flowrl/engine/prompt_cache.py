"""PromptCache: prompt text -> its PromptEncoding, bounded in bytes, evicting the least recently used.

A prompt's encoding is computed once and reused by every later request with the same text (a
training step sends each prompt n times; validation repeats the same prompts every few steps). The
bound is the sum of the stored tensors' bytes (embeds, mask, pooled), which is what the memory
costs: SD3.5's T5 embeddings take megabytes per prompt, so a count of entries says little.

Entries live on the host (pinned memory when the compute device is a GPU). `get` returns the
encoding on the compute device: from pinned host memory the copy is non-blocking, so a lookup never
waits for the device. Every entry
is its own copy (an encoder's batched output is sliced per prompt, and a slice would keep the
whole batch alive), so the bytes counted are the bytes held.

The cache knows nothing about models or requests; it is used by the engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flowrl.models.base import PromptEncoding


def encoding_nbytes(encoding: PromptEncoding) -> int:
    """Bytes held by an encoding's tensors."""
    tensors = (encoding.embeds, encoding.mask, encoding.pooled)
    return sum(t.nbytes for t in tensors if t is not None)


class PromptCache:
    def __init__(self, max_bytes: int, compute_device: torch.device):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prompt cache max_bytes={max_bytes!r} must be an integer >= 0 (0 disables the cache)")
        self.max_bytes = max_bytes
        self.compute_device = torch.device(compute_device)
        self.storage_device = torch.device("cpu")
        self._pin = self.compute_device.type == "cuda"
        self._entries: OrderedDict[str, tuple[PromptEncoding, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, text: str) -> bool:
        return text in self._entries

    def get(self, text: str) -> PromptEncoding | None:
        """The encoding of `text` on the compute device (None when absent); marks it most recent."""
        if text not in self._entries:
            return None
        self._entries.move_to_end(text)
        stored = self._entries[text][0]
        if self.storage_device == self.compute_device:
            return stored
        return _map(stored, lambda t: t.to(self.compute_device, non_blocking=self._pin))

    def put(self, text: str, encoding: PromptEncoding) -> None:
        """Store a copy of `encoding`; evict least recently used entries until the bound holds.
        An encoding larger than the whole bound is not stored."""
        self.discard(text)
        size = encoding_nbytes(encoding)
        if size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            self.discard(next(iter(self._entries)))
        self._entries[text] = (_map(encoding, self._stored_copy), size)
        self.nbytes += size

    def discard(self, text: str) -> None:
        entry = self._entries.pop(text, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def _stored_copy(self, t: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(t.shape, dtype=t.dtype, device=self.storage_device, pin_memory=self._pin)
        return copy.copy_(t.detach())


def _map(encoding: PromptEncoding, fn) -> PromptEncoding:
    pooled = None if encoding.pooled is None else fn(encoding.pooled)
    return PromptEncoding(fn(encoding.embeds), fn(encoding.mask), pooled)
