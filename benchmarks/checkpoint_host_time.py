"""Gradient checkpointing of compiled blocks: inside each block's compiled graph, around it, or none.

One training micro-batch (forward + backward of the trainer's log-prob, LoRA on the attention
projections, the blocks compiled in place as `engine.compile: true` does) is timed three ways
in one process: checkpoints inside each block's compiled graph (what flowrl does,
`flowrl.accel.regional_compile.checkpoint_inside`), diffusers' own checkpoint around each
compiled block, and no checkpointing. For each: the median step time, the activations kept for
backward (bytes of the storages autograd saves that are not the model's parameters), and whether
the log-probs equal those of the first mode. With a tiny model (`--model tiny-qwen`, block 0
repeated to `--blocks`) the arithmetic is small, so the step time is mostly the host's: what
each mode costs in Python and dispatch. `--model qwen-image` on a GPU times the real step.

    python benchmarks/checkpoint_host_time.py --model tiny-qwen --blocks 60
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from flowrl.accel.regional_compile import take_checkpoints_inside
from flowrl.bench.logprob import PROMPT, _rollout_tensors
from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.bench.report import resolve_device_dtype, saved_activation_bytes, synchronize
from flowrl.engine.engine import DiffusionEngine
from flowrl.engine.output import TransitionSpec
from flowrl.sampling_params import SamplingParams
from flowrl.trainer.policy import score_transitions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen", help="tiny-qwen | tiny-sd3 | qwen-image | sd35-medium")
    parser.add_argument("--blocks", type=int, default=60, help="tiny models: repeat block 0 to this many blocks")
    parser.add_argument("--samples", type=int, default=2, help="samples per micro-batch (2 rows each with CFG)")
    parser.add_argument("--guidance-scale", type=float, default=2.0)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    adapter = build_bench_model(args.model, device, dtype).adapter
    transformer = adapter.transformer
    if args.model.startswith("tiny-"):
        transformer.transformer_blocks = torch.nn.ModuleList(
            [copy.deepcopy(transformer.transformer_blocks[0]) for _ in range(args.blocks)]
        )
    params = make_trainable(transformer, args.lora_rank, adapter.default_lora_targets)
    engine = DiffusionEngine(adapter, max_batch_rows=4 * args.samples, compile="inductor")  # compiles in place
    sampling = SamplingParams(
        height=args.size,
        width=args.size,
        num_inference_steps=3,
        guidance_scale=args.guidance_scale,
        noise_level=0.7,
        seed=0,
    )
    tensors = _rollout_tensors(engine.generate_batched(PROMPT, args.samples, sampling))
    engine.shutdown()
    spec = TransitionSpec(
        height=args.size,
        width=args.size,
        num_inference_steps=3,
        noise_level=0.7,
        sde_type="sde",
        guidance_scale=args.guidance_scale,
    )
    step_index = torch.zeros(args.samples, dtype=torch.long)
    log_probs: dict[str, torch.Tensor] = {}

    def forward_backward(mode: str) -> None:
        result = score_transitions(adapter, tensors, step_index, spec, None)
        log_probs[mode] = result.log_prob.detach().cpu()
        result.log_prob.sum().backward()
        for p in params:
            p.grad = None

    def inside() -> None:
        transformer.enable_gradient_checkpointing()
        take_checkpoints_inside(transformer)

    modes = {
        "inside": inside,
        "around": transformer.enable_gradient_checkpointing,  # diffusers' own checkpoint function
        "none": transformer.disable_gradient_checkpointing,
    }
    print(
        f"{args.model}, {len(transformer.transformer_blocks)} blocks, {args.samples} samples x "
        f"{2 if args.guidance_scale > 1 else 1} rows, {device}, {dtype}"
    )
    with torch.enable_grad():
        for mode, setup in modes.items():
            setup()
            for _ in range(2):  # compile and warm up
                forward_backward(mode)
            seconds = []
            for _ in range(args.repeats):
                synchronize(device)
                t0 = time.perf_counter()
                forward_backward(mode)
                synchronize(device)
                seconds.append(time.perf_counter() - t0)
            saved = saved_activation_bytes(lambda: forward_backward(mode), transformer)
            same = torch.equal(log_probs[mode], log_probs["inside"])
            print(
                f"  checkpoint {mode:7s} {statistics.median(seconds) * 1000:9.1f} ms per fwd+bwd   "
                f"activations kept {saved / 2**20:9.3f} MB   log-probs equal to inside's: {same}"
            )


if __name__ == "__main__":
    main()
