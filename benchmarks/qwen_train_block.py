"""One full-size Qwen-Image block's training forward + backward, compiled as the trainer's grad
graph is, against the same block's forward without grad (the rollout's graph) at the same rows:
where the update's time per FLOP goes.

    python benchmarks/qwen_train_block.py [--rows 8] [--text-mask] [--seconds 2]
        [--variants LAYOUT:ROUNDING[:OPTION=INT...],...] [--device cuda]

Each variant (qwen_block_variants.py's syntax and switches: `lora=R`, `lora_mlp=1`, ...) is built
and compiled once, then timed two ways:
- train: a forward with grad and a backward of fixed random cotangents of both streams' outputs,
  into the block's inputs (an inner block's inputs carry grad) and its LoRA weights, whose
  gradients accumulate call after call as the update's micro-batches accumulate them;
- forward: the same block called without grad.
It prints ms per call of each and their ratio (flowrl.bench.train_flops counts about 2.1 x a
forward's FLOPs for a LoRA forward + backward at the Qwen-Image recipe's settings: no gradient of
the frozen base weights), the largest difference between the two graphs' outputs (the rounding
behind the trainer's log-prob gap), how long each graph's first call took (it compiles: with
`coordinate_descent_tuning=0` among the variant's options, compiling without tuning the kernels'
launch configurations), the LoRA gradients' count, the kernels that take the training
call's time and, on a GPU, its long gaps (flowrl.bench.step_profile). The default rows, 8, are the
Qwen-Image recipe's micro-batch: 4 samples x 2 CFG rows. On a CPU it runs a small block as a
smoke test.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from qwen_block_variants import add_block_arguments, compiled_variants, kernel_table, print_kernels
from timing import sustained_seconds

from flowrl.bench.flops import synchronize

STREAMS = ("hidden_states", "encoder_hidden_states")


def forward(block, kwargs: dict):
    with torch.no_grad():
        return block(**kwargs)


def train(block, kwargs: dict, cotangents: tuple) -> None:
    """One training call: the inputs' gradients start afresh, the LoRA weights' accumulate."""
    for name in STREAMS:
        kwargs[name].grad = None
    torch.autograd.backward(block(**kwargs), cotangents)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_block_arguments(
        parser,
        rows=8,  # the recipe's micro-batch
        variants="sequence-major:eager:lora=64:lora_mlp=1,sequence-major:eager:lora=64,sequence-major:eager",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant and mode")
    parser.add_argument("--top", type=int, default=16, help="kernels listed per variant")
    parser.add_argument("--profile-calls", type=int, default=3, help="training calls profiled per variant")
    args = parser.parse_args()
    device = torch.device(args.device)
    for spec, block, kwargs in compiled_variants(args):
        for name in STREAMS:
            kwargs[name].requires_grad_(True)
        start = time.perf_counter()
        no_grad_out = forward(block, kwargs)  # compiles the no-grad graph
        synchronize(device)
        compile_seconds = {"no-grad": time.perf_counter() - start}
        torch.manual_seed(1)
        cotangents = tuple(torch.randn_like(t) for t in no_grad_out)
        start = time.perf_counter()
        with torch.enable_grad():
            grad_out = block(**kwargs)  # compiles the grad graph's forward
        gap = max((g.detach().float() - n.float()).abs().max().item() for g, n in zip(grad_out, no_grad_out))
        torch.autograd.backward(grad_out, cotangents)  # and its backward
        synchronize(device)
        compile_seconds["grad"] = time.perf_counter() - start
        del grad_out
        train_call = functools.partial(train, block, kwargs, cotangents)
        forward_call = functools.partial(forward, block, kwargs)
        train_seconds = sustained_seconds(train_call, device, args.seconds)["seconds"]
        forward_seconds = sustained_seconds(forward_call, device, args.seconds)["seconds"]
        kernels, gaps = kernel_table(train_call, device, args.profile_calls)
        lora_grads = [p.grad for name, p in block.named_parameters() if "lora_" in name]
        assert all(g is not None and bool(g.isfinite().all()) for g in lora_grads), "a LoRA weight got no gradient"
        print(
            f"\n{spec}   max |grad graph - no-grad graph| {gap:.3g}; {len(lora_grads)} LoRA gradients\n"
            f"  first calls, compiling: no-grad graph {compile_seconds['no-grad']:.1f} s, grad graph "
            f"(forward + backward) {compile_seconds['grad']:.1f} s\n"
            f"  forward (no grad)  {forward_seconds * 1e3:8.3f} ms per call\n"
            f"  train (fwd + bwd)  {train_seconds * 1e3:8.3f} ms per call = {train_seconds / forward_seconds:.2f} x "
            f"the forward; {sum(ms for _, ms, _ in kernels):7.3f} ms in {sum(n for *_, n in kernels)} kernels "
            "per call, of which:"
        )
        print_kernels(kernels, args.top, gaps)
        del block
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
