"""flowrl.distributed.parallel's pieces that need no launch."""

from __future__ import annotations

import torch

from flowrl.distributed.parallel import _owning


def test_a_gathered_view_into_padded_shards_is_copied_to_its_own_storage():
    """FSDP2 gathers a (1, 2, d) parameter over two ranks as a view of its padded shards; saving
    it as it is fails in safetensors (bug: the Wan export of a sharded run), so it is copied."""
    padded = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4)
    view = padded[:1]
    owned = _owning(view)
    assert torch.equal(owned, view)
    assert owned.untyped_storage().nbytes() == owned.numel() * owned.element_size()
    whole = torch.ones(3, 4)
    assert _owning(whole) is whole  # a tensor with its own storage is kept, not copied
