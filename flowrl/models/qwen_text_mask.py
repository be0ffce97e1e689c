"""Qwen-Image's text mask normalised on the device, with no host-to-device copy.

diffusers' QwenImageTransformer2DModel.forward, given a text mask (a batch of padded prompts, as
true CFG's shorter negative prompt makes), first normalises it in
`transformer_qwenimage.compute_text_seq_len_from_mask`, which builds one of its operands with
`torch.as_tensor(text_seq_len, device=...)`: a copy of a Python int from pageable host memory,
which waits until the device has run all the work queued before it. So every such forward, in
the rollout and in each of the update's micro-batches, stopped the host from running ahead of
the device (`tests/trainer/test_gpu.py` counts the update's waits).

`avoid_scalar_copy()` puts `mask_lengths_on_device` in its place in that module (process-wide,
once): the same three results (the text length for RoPE, each row's length after its last valid
token, the boolean mask) with the int passed to `torch.where` as a scalar, which no copy carries.
"""

from __future__ import annotations

import torch


def mask_lengths_on_device(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None):
    """(text length, per-row lengths (B,) or None, bool mask or None), as diffusers computes them:
    a row's length ends after its last True, and a row with none keeps the full text length."""
    batch, length = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None or tuple(encoder_hidden_states_mask.shape[:2]) != (batch, length):
        # no mask (nothing is copied there), or a wrong shape (diffusers' own error)
        return mask_lengths_on_device.diffusers_function(encoder_hidden_states, encoder_hidden_states_mask)
    mask = encoder_hidden_states_mask.to(torch.bool)
    positions = torch.arange(length, device=mask.device)
    after_last = torch.where(mask, positions, 0).max(dim=1).values + 1
    return length, torch.where(mask.any(dim=1), after_last, length), mask


def avoid_scalar_copy() -> bool:
    """Install `mask_lengths_on_device` in diffusers' Qwen-Image transformer module; False where
    that diffusers has no such function to replace, or it was replaced already."""
    from diffusers.models.transformers import transformer_qwenimage

    current = getattr(transformer_qwenimage, "compute_text_seq_len_from_mask", None)
    if current is None or current is mask_lengths_on_device:
        return False
    mask_lengths_on_device.diffusers_function = current
    transformer_qwenimage.compute_text_seq_len_from_mask = mask_lengths_on_device
    return True
