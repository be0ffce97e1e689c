"""Two streams' projections written straight into one joint buffer: the v of Qwen-Image's joint
attention without the copy that joins it.

Joint attention reads v as one (T + L, B, H*D) sequence-major buffer, text rows first. Projected
separately, text and image v are two GEMM outputs, and inductor copies them into that buffer (it
writes a GEMM's result only into a buffer of its own): 0.049 ms per B=16 block on an H200, about
0.7% of a rollout (docs/benchmarks.md run 22). This custom op runs the same two cuBLAS calls
(`addmm` with the bias, as `F.linear` does) with `out=` the two row ranges of the joint buffer,
so the values are the ones `torch.cat([F.linear(txt, ...), F.linear(img, ...)])` gives, bit for
bit (tests/models/test_joint_linear.py). Inductor keeps a custom op whole and calls it.

Used where the q/k kernel is (rollout graphs, no grad; `qwen_block._joint_qkv`) and only for
plain `nn.Linear` projections: a LoRA-wrapped projection adds its low-rank term to the GEMM's
output anyway, and inductor already writes that sum into the joint buffer.
"""

from __future__ import annotations

import torch


def _linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


@torch.library.custom_op("flowrl::joint_linear", mutates_args=())
def joint_linear(txt: torch.Tensor, txt_weight: torch.Tensor, txt_bias: torch.Tensor | None,
                 img: torch.Tensor, img_weight: torch.Tensor, img_bias: torch.Tensor | None) -> torch.Tensor:
    """(T + L, B, N): txt (T, B, K) and img (L, B, K) through their own linear layers, joined."""
    out = txt.new_empty((txt.shape[0] + img.shape[0], txt.shape[1], txt_weight.shape[0]))
    rows = out.view(-1, out.shape[-1])
    txt_rows = txt.shape[0] * txt.shape[1]
    _linear_into(txt.reshape(txt_rows, -1), txt_weight, txt_bias, rows[:txt_rows])
    _linear_into(img.reshape(-1, img.shape[-1]), img_weight, img_bias, rows[txt_rows:])
    return out


@joint_linear.register_fake
def _(txt, txt_weight, txt_bias, img, img_weight, img_bias):
    return txt.new_empty((txt.shape[0] + img.shape[0], txt.shape[1], txt_weight.shape[0]))


def applies(txt_proj: torch.nn.Module, img_proj: torch.nn.Module) -> bool:
    """Both projections are plain nn.Linear (not LoRA-wrapped) with equal output widths."""
    return (type(txt_proj) is torch.nn.Linear and type(img_proj) is torch.nn.Linear
            and txt_proj.out_features == img_proj.out_features)


def joint_projection(txt: torch.Tensor, txt_proj: torch.nn.Linear, img: torch.Tensor, img_proj: torch.nn.Linear) -> torch.Tensor:
    """The joint (T + L, B, N) output of txt_proj(txt) and img_proj(img), sequence-major inputs."""
    return joint_linear(txt.contiguous(), txt_proj.weight, txt_proj.bias, img.contiguous(), img_proj.weight, img_proj.bias)
