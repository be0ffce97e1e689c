"""flowrl.accel.qwen_image.joint_linear: two streams' projections written into one joint buffer
give what projecting and joining give, bit for bit, eagerly and inside a compiled graph with a
dynamic batch; modules it cannot compute (here a wrapper around a Linear) are left to the ordinary
path (LoRA projections whose low-rank term folds: tests/accel/test_lora_fold.py)."""

from __future__ import annotations

import pytest
import torch

from flowrl.accel.qwen_image import joint_linear


def _streams(dtype, batch=3, txt_tokens=5, img_tokens=11, width=24):
    gen = torch.Generator().manual_seed(0)
    txt = torch.randn(txt_tokens, batch, width, generator=gen).to(dtype)
    img = torch.randn(img_tokens, batch, width, generator=gen).to(dtype)
    return txt, img


def _projections(dtype, bias: bool, width=24, out=16):
    torch.manual_seed(1)
    return torch.nn.Linear(width, out, bias=bias).to(dtype), torch.nn.Linear(width, out, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_joint_projection_equals_projecting_then_joining(dtype, bias):
    txt, img = _streams(dtype)
    txt_proj, img_proj = _projections(dtype, bias)
    with torch.no_grad():
        got = joint_linear.joint_projection(txt, txt_proj, img, img_proj)
        want = torch.cat([txt_proj(txt), img_proj(img)])
    assert got.shape == (16, 3, 16) and got.dtype == dtype
    assert torch.equal(got, want)


def test_joint_projection_compiles_with_a_dynamic_batch():
    txt_proj, img_proj = _projections(torch.float32, bias=True)
    compiled = torch.compile(
        lambda t, i: joint_linear.joint_projection(t, txt_proj, i, img_proj) * 2, backend="aot_eager"
    )
    with torch.no_grad():
        for batch in (2, 3):
            txt, img = _streams(torch.float32, batch=batch)
            torch._dynamo.mark_dynamic(txt, 1)
            torch._dynamo.mark_dynamic(img, 1)
            assert torch.equal(compiled(txt, img), torch.cat([txt_proj(txt), img_proj(img)]) * 2)


def test_only_plain_linear_projections_apply():
    class Wrapped(torch.nn.Module):  # what a LoRA layer looks like from here: a module around the Linear
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    txt_proj, img_proj = _projections(torch.float32, bias=True)
    assert joint_linear.applies(txt_proj, img_proj)
    assert not joint_linear.applies(Wrapped(txt_proj), img_proj)
    assert not joint_linear.applies(txt_proj, torch.nn.Linear(24, 8))
