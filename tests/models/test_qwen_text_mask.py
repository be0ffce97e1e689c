"""Qwen-Image's text mask normalised without a host-to-device copy (flowrl.models.qwen_text_mask):
the same results as diffusers' function, and no tensor made from host data in a padded forward."""

import pytest
import torch

from flowrl.models.qwen_text_mask import mask_lengths_on_device


@pytest.fixture(scope="module")
def qwen_adapter(tiny_qwen_path):
    from flowrl.models import load_adapter

    return load_adapter(tiny_qwen_path)


def _masks(batch: int, length: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    right_padded = torch.arange(length)[None, :] < torch.tensor([length, 3, 1, 5])[:batch, None]
    holes = torch.rand(batch, length, generator=gen) > 0.5  # not contiguous: lengths end after the last True
    holes[1] = False  # a row with no valid token keeps the full length
    return [right_padded, holes, holes.float(), right_padded.to(torch.int64)]


def test_the_lengths_and_mask_equal_diffusers_own(qwen_adapter):
    from diffusers.models.transformers import transformer_qwenimage

    diffusers_function = mask_lengths_on_device.diffusers_function  # installed by the adapter
    assert transformer_qwenimage.compute_text_seq_len_from_mask is mask_lengths_on_device
    states = torch.randn(4, 7, 8)
    for mask in _masks(4, 7):
        length, per_row, normalised = mask_lengths_on_device(states, mask)
        want_length, want_per_row, want_mask = diffusers_function(states, mask)
        assert length == want_length == 7
        assert per_row.dtype == want_per_row.dtype and torch.equal(per_row, want_per_row)
        assert normalised.dtype == torch.bool and torch.equal(normalised, want_mask)
    assert mask_lengths_on_device(states, None) == (7, None, None)
    with pytest.raises(ValueError, match="must match"):
        mask_lengths_on_device(states, torch.ones(4, 6, dtype=torch.bool))


def test_a_padded_forward_makes_no_tensor_from_host_data_on_its_device(qwen_adapter, monkeypatch):
    """A tensor built from Python data on a GPU is a copy from pageable memory, which waits for the
    device; a forward over prompts of two lengths (a padded text mask) makes none."""
    cond = qwen_adapter.encode_prompts(["a red square on a blue background", "cat"])
    assert cond[0].embeds.shape[0] != cond[1].embeds.shape[0]  # the forward pads and masks
    latents = torch.randn(2, 16, qwen_adapter.latent_channels * 4)
    sigmas = torch.full((2,), 0.5)
    made = []
    for name in ("as_tensor", "tensor"):
        original = getattr(torch, name)

        def recording(data, *args, _original=original, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                made.append(data)
            return _original(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, recording)
    with torch.no_grad():
        out = qwen_adapter.velocity(latents, sigmas, cond, [None, None], torch.ones(2), 64, 64)
    assert out.shape == latents.shape and torch.isfinite(out).all()
    assert made == []
