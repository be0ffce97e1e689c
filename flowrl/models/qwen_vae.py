"""Qwen-Image's VAE decoding one image as 2D convolutions.

The Qwen-Image VAE is a causal video VAE: every convolution is a Conv3d with a kernel of 3 in
time, padded with 2 zero frames in front. A text-to-image decode is one frame with no frame
cache, so 2 of the 3 time taps of every 3x3x3 kernel multiply zeros: two thirds of the decoder's
FLOPs are wasted (benchmarks/qwen_vae_decode.py times both ways).

`decode_single_frames_in_2d(vae)` switches every causal Conv3d of the VAE, per instance, to a
forward that recognises that case (one frame, no cache, front padding of kernel-1 frames, time
stride 1) and computes it as a Conv2d with the kernel's last time slice: the only slice that
meets the real frame. The result is the same sum without the zero terms (equal up to float
summation order). The 2D path is taken only inside `single_frame_2d()` (the adapter's decode
enters it), so the same modules called by the diffusers pipeline (the benchmark's baseline)
run stock. Any other call (videos, cached chunks) runs the module's own forward.

The 2D convolutions take and give channels-last tensors: cuDNN's fast bf16 kernels are NHWC, and
a channels-last activation stays channels-last through the decoder's norms, SiLUs, residual adds
and upsampling, so no layout conversion runs between convolutions.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch
import torch.nn.functional as F

_ENABLED = contextvars.ContextVar("flowrl_single_frame_2d", default=False)


@contextlib.contextmanager
def single_frame_2d():
    """Within this block (this thread), switched VAE convolutions take the 2D path."""
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _is_single_frame_call(conv: torch.nn.Conv3d, x: torch.Tensor, cache_x) -> bool:
    kernel_t = conv.kernel_size[0]
    return (
        _ENABLED.get()
        and cache_x is None
        and x.dim() == 5
        and x.shape[2] == 1
        and conv.stride[0] == 1
        and conv.dilation[0] == 1
        and conv._padding[4] == kernel_t - 1
        and conv._padding[5] == 0
    )


def _single_frame_forward(self, x: torch.Tensor, cache_x=None) -> torch.Tensor:
    if not _is_single_frame_call(self, x, cache_x):
        return type(self).forward(self, x, cache_x)
    pad_w, pad_w_end, pad_h, pad_h_end = self._padding[:4]
    frame = x[:, :, 0].contiguous(memory_format=torch.channels_last)
    weight = self.weight[:, :, -1].contiguous(memory_format=torch.channels_last)
    if (pad_w, pad_h) == (pad_w_end, pad_h_end):  # symmetric: let the convolution pad
        out = F.conv2d(frame, weight, self.bias, self.stride[1:], (pad_h, pad_w), self.dilation[1:], self.groups)
    else:
        out = F.conv2d(
            F.pad(frame, self._padding[:4]), weight, self.bias, self.stride[1:], 0, self.dilation[1:], self.groups
        )
    return out.unsqueeze(2)


def decode_single_frames_in_2d(vae: torch.nn.Module) -> int:
    """Switch the causal Conv3d layers of a diffusers AutoencoderKLQwenImage to the single-frame
    2D path (idempotent). Returns how many layers were switched. Parameters and state_dict are
    unchanged; the time slice is taken at every call, so later weight loads are honoured."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    switched = 0
    for module in vae.modules():
        if isinstance(module, QwenImageCausalConv3d) and not getattr(module, "_flowrl_single_frame_2d", False):
            module.forward = types.MethodType(_single_frame_forward, module)
            module._flowrl_single_frame_2d = True
            switched += 1
    return switched
