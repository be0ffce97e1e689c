"""What the rollout's LoRA projections would save as GEMMs over a joint contraction [x | x A^T].

The rollout's folded LoRA op (flowrl.accel.lora_fold.linear_into) runs each adapted projection as
three GEMMs: x A^T, the low-rank GEMM with the bias writing the full-width output, and the base
GEMM accumulating into it (beta = 1, so it reads that output back). At the Qwen-Image recipe's 64
rollout rows a block's image stream is 65,536 tokens, and its LoRA overhead (31.0 against 28.4 ms
a block, docs/performance.md) is mostly that traffic: each projection reads x once more for x A^T
and writes and reads its whole output once more.

The image stream's q, k and v share their input x, so one buffer [x A_q^T | x | x A_k^T | x A_v^T]
serves all three as column windows (q: [x A_q^T | x] against [s B_q | W_q]; k: [x | x A_k^T]
against [W_k | s B_k]; v: the whole buffer against [W_v | 0 | s B_v]): one copy of x, one GEMM
for the three A factors, and each output written once by its one GEMM. The MLP's first GEMM (GELU
in its epilogue) can write its activation into the first columns of [h | h A^T], so its second
projection is one GEMM too. This script times, alternating, one block's image-stream q, k, v and
MLP projections:

- base: the GEMMs without LoRA (the floor);
- folded: the shipped rollout ops (linear_into; the MLP's first projection as
  lora_linear_gelu_tanh);
- joint-qkv: q, k, v over the joint buffer, the MLP as folded;
- joint: joint-qkv, and the MLP's second projection over [h | h A^T].

It prints each variant's time per block, its kernels per call and its largest difference from a
float32 reference.

    python benchmarks/lora_joint_k.py                  # on a GPU, the recipe's rollout shapes
    python benchmarks/lora_joint_k.py --device cpu --tokens 64 --width 32 --mlp-width 64 --rank 4 \\
        --seconds 0.05 --rounds 1                      # a smoke run
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from timing import add_arguments, alternate, kernel_names, rounds_line

from flowrl.accel.lora_fold import linear_into, lora_linear_gelu_tanh


def build(tokens: int, width: int, mlp_width: int, rank: int, device, dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    def layer(k, n):
        return {"weight": rand(n, k), "bias": rand(n), "down": rand(rank, k), "up": rand(n, rank)}

    return {
        "x": rand(tokens, width, scale=1.0),
        "q": layer(width, width),
        "k": layer(width, width),
        "v": layer(width, width),
        "up": layer(width, mlp_width),
        "down": layer(mlp_width, width),
    }


def _gelu_linear(x, weight, bias):
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(torch.addmm(bias, x, weight.t()), approximate="tanh")


def base(p):
    x = p["x"]
    q, k, v = (torch.addmm(p[n]["bias"], x, p[n]["weight"].t()) for n in "qkv")
    h = _gelu_linear(x, p["up"]["weight"], p["up"]["bias"])
    return q, k, v, torch.addmm(p["down"]["bias"], h, p["down"]["weight"].t())


def _folded_linear(x, layer):
    out = x.new_empty((x.shape[0], layer["weight"].shape[0]))
    linear_into(x, layer["weight"], layer["bias"], out, layer["down"], layer["up"])
    return out


def _folded_mlp(x, p):
    up, down = p["up"], p["down"]
    h = lora_linear_gelu_tanh(x, up["weight"], up["bias"], up["down"], up["up"])
    return _folded_linear(h, down)


def folded(p):
    x = p["x"]
    return (*(_folded_linear(x, p[n]) for n in "qkv"), _folded_mlp(x, p))


def _joint_qkv(p):
    """q, k, v as GEMMs over column windows of [x A_q^T | x | x A_k^T | x A_v^T]."""
    x = p["x"]
    q, k, v = p["q"], p["k"], p["v"]
    rank, width = q["down"].shape
    low = torch.mm(x, torch.cat([q["down"], k["down"], v["down"]]).t())
    joint = x.new_empty((x.shape[0], width + 3 * rank))
    joint[:, rank : rank + width].copy_(x)
    joint[:, :rank].copy_(low[:, :rank])
    joint[:, rank + width :].copy_(low[:, rank:])
    zeros = v["up"].new_zeros((v["up"].shape[0], rank))
    return (
        torch.addmm(q["bias"], joint[:, : rank + width], torch.cat([q["up"], q["weight"]], dim=1).t()),
        torch.addmm(k["bias"], joint[:, rank : 2 * rank + width], torch.cat([k["weight"], k["up"]], dim=1).t()),
        torch.addmm(v["bias"], joint[:, rank:], torch.cat([v["weight"], zeros, v["up"]], dim=1).t()),
    )


def joint_qkv(p):
    return (*_joint_qkv(p), _folded_mlp(p["x"], p))


def joint(p):
    """joint_qkv, with the MLP's activation written into [h | h A^T] and its second projection as
    one GEMM over it."""
    x, up, down = p["x"], p["up"], p["down"]
    rank, mlp_width = down["down"].shape
    first = torch.cat([x, torch.mm(x, up["down"].t())], dim=1)
    hidden = x.new_empty((x.shape[0], mlp_width + rank))
    h = hidden[:, :mlp_width]
    if x.is_cuda:
        torch._addmm_activation(up["bias"], first, torch.cat([up["weight"], up["up"]], dim=1).t(), use_gelu=True, out=h)
    else:
        h.copy_(_gelu_linear(first, torch.cat([up["weight"], up["up"]], dim=1), up["bias"]))
    torch.mm(h, down["down"].t(), out=hidden[:, mlp_width:])
    out = torch.addmm(down["bias"], hidden, torch.cat([down["weight"], down["up"]], dim=1).t())
    return (*_joint_qkv(p), out)


VARIANTS = {"base": base, "folded": folded, "joint-qkv": joint_qkv, "joint": joint}


def reference(p):
    """float32 q, k, v and MLP output with LoRA, the unfused expression."""
    f = {n: {key: t.float() for key, t in layer.items()} for n, layer in p.items() if n != "x"}
    x = p["x"].float()

    def lin(x, layer):
        return F.linear(x, layer["weight"], layer["bias"]) + (x @ layer["down"].t()) @ layer["up"].t()

    h = F.gelu(lin(x, f["up"]), approximate="tanh")
    return (*(lin(x, f[n]) for n in "qkv"), lin(h, f["down"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64 * 1024, help="image rows (the recipe's 64 rows x 1024)")
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--mlp-width", type=int, default=12288)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    add_arguments(parser, seconds=2.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    params = build(args.tokens, args.width, args.mlp_width, args.rank, device, dtype)
    names = args.variants.split(",")
    expected = reference(params)
    for name in names:
        got = VARIANTS[name](params)
        if name == "base":
            continue
        err = max((g.float() - e).abs().max().item() for g, e in zip(got, expected))
        scale = max(e.abs().max().item() for e in expected)
        line = f"{name}: max |diff| from float32 {err:.3e} (outputs up to {scale:.3e})"
        if device.type == "cuda":
            kernels = kernel_names(lambda: VARIANTS[name](params))
            line += f", {len(kernels)} kernels: " + ", ".join(sorted(set(kernels)))[:600]
        print(line, flush=True)
    times = alternate({n: (lambda f=VARIANTS[n]: f(params)) for n in names}, device, args.rounds, args.seconds)
    floor = statistics.median(times["base"]) if "base" in times else None
    for name in names:
        line = rounds_line(f"{name:10s}", times[name])
        if floor:
            line += f"   +{(statistics.median(times[name]) - floor) * 1e3:6.3f} ms over base"
        print(line, flush=True)


if __name__ == "__main__":
    main()
