"""The prompt cache: bounded in bytes, least-recently-used eviction, stored where configured, and
settable from the config."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.engine.prompt_cache import PromptCache, encoding_nbytes
from flowrl.models.base import PromptEncoding


def _encoding(length: int, dim: int = 8, pooled: bool = True) -> PromptEncoding:
    return PromptEncoding(
        torch.randn(length, dim), torch.ones(length, dtype=torch.bool), torch.randn(4) if pooled else None
    )


@settings(max_examples=200, deadline=None)
@given(
    max_bytes=st.integers(0, 2000),
    ops=st.lists(st.tuples(st.sampled_from("put get".split()), st.integers(0, 7), st.integers(1, 12)), max_size=40),
)
def test_byte_bound_holds_and_evictions_are_lru(max_bytes, ops):
    cache = PromptCache(max_bytes, torch.device("cpu"))
    model: OrderedDict[str, int] = OrderedDict()  # text -> bytes, least recently used first
    for op, key, length in ops:
        text = f"prompt {key}"
        if op == "put":
            encoding = _encoding(length)
            size = encoding_nbytes(encoding)
            model.pop(text, None)
            if size <= max_bytes:
                while sum(model.values()) + size > max_bytes:
                    model.popitem(last=False)
                model[text] = size
            cache.put(text, encoding)
        else:
            found = cache.get(text)
            assert (found is not None) == (text in model)
            if found is not None:
                model.move_to_end(text)
        assert cache.nbytes == sum(model.values()) <= max_bytes
        assert list(cache._entries) == list(model)  # the same entries in the same recency order


def test_entries_are_copies_so_the_bytes_counted_are_the_bytes_held():
    batch = torch.randn(16, 300, 8)  # an encoder's batched output: each prompt's row is a view of it
    cache = PromptCache(2**20, torch.device("cpu"))
    cache.put("a cat", PromptEncoding(batch[3], torch.ones(300, dtype=torch.bool)))
    stored = cache.get("a cat")
    assert stored.embeds.untyped_storage().nbytes() == stored.embeds.nbytes  # not the whole batch
    torch.testing.assert_close(stored.embeds, batch[3], rtol=0, atol=0)
    assert cache.nbytes == 300 * 8 * 4 + 300


def test_an_encoding_larger_than_the_bound_is_not_stored_and_zero_disables():
    cache = PromptCache(100, torch.device("cpu"))
    cache.put("long", _encoding(50))
    assert "long" not in cache and cache.nbytes == 0
    off = PromptCache(0, torch.device("cpu"))
    off.put("short", _encoding(1, pooled=False))
    assert len(off) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_bound_is_refused(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        PromptCache(bad, torch.device("cpu"))


def test_engine_cache_is_bounded_and_set_from_the_config(tiny_sd3_path, params):
    from flowrl.config import load_config
    from flowrl.engine import DiffusionEngine

    cfg = load_config(None, ["engine.prompt_cache_mb=1"]).engine
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, prompt_cache_mb=cfg.prompt_cache_mb)
    try:
        first = engine.generate("a cat", params)
        again = engine.generate("a cat", params)
        torch.testing.assert_close(first.all_latents, again.all_latents, rtol=0, atol=0)
        stats = engine.stats()
        assert stats["num_prompt_encodes"] == 1 and stats["num_prompt_cache_hits"] == 1
        assert stats["prompt_cache_entries"] == 1 and 0 < stats["prompt_cache_bytes"] <= 2**20
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="engine.prompt_cache_mb=-1"):
        load_config(None, ["engine.prompt_cache_mb=-1"])


@pytest.mark.gpu
def test_host_cache_is_pinned_and_returns_device_tensors():
    cache = PromptCache(2**20, torch.device("cuda"))
    encoding = _encoding(10)
    cache.put("a cat", PromptEncoding(*(t.cuda() for t in (encoding.embeds, encoding.mask, encoding.pooled))))
    stored = cache._entries["a cat"][0]
    assert stored.embeds.device.type == "cpu" and stored.embeds.is_pinned()
    found = cache.get("a cat")
    assert found.embeds.device.type == "cuda"
    torch.testing.assert_close(found.embeds.cpu(), encoding.embeds, rtol=0, atol=0)
