"""The compiled Qwen-Image forward with batch-major and with sequence-major blocks, A/B on one GPU.

    python benchmarks/qwen_forward_ab.py [--rows 16] [--size 512] [--compile-rounding eager] [--rounds 3]

Builds the model twice (the same seeded random weights at the published architecture), switches
one copy's blocks to the batch-major baseline (`prepare_for_compile(..., sequence_major=False)`,
the engine before sequence-major blocks) and leaves the other as the engine compiles it, compiles
both, then times one forward of `--rows` rows (adapter.velocity, as the engine calls it) of each,
alternating A, B, A, B for `--rounds` rounds so that clock and temperature drift hit both alike.
Prints ms per forward per round, the median of each and their ratio, and the largest difference
between the two outputs (bf16 rounding; the layouts are equal in float32). A CPU run uses the
tiny model (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flowrl.bench import alternating
from flowrl.bench.floor import _forward_fn
from flowrl.bench.models import build_bench_model
from flowrl.bench.report import quiet_libraries
from flowrl.models.qwen_block import prepare_for_compile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--compile-rounding", default="eager", choices=("eager", "fused"))
    alternating.add_arguments(parser, seconds=3.0)
    args = parser.parse_args()
    quiet_libraries()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    model, dtype, backend = ("qwen-image", torch.bfloat16, "inductor") if on_gpu else ("tiny-qwen", torch.float32, "aot_eager")
    size = args.size if on_gpu else 64
    forwards, outputs = {}, {}
    for layout in ("batch-major", "sequence-major"):
        adapter = build_bench_model(model, device, dtype).adapter
        prepare_for_compile(adapter.transformer, sequence_major=layout == "sequence-major")
        adapter.compile_modules(backend, args.compile_rounding)
        forwards[layout] = _forward_fn(adapter, args.rows, size, size, 1.0)
        with torch.no_grad():
            outputs[layout] = forwards[layout]().float()  # compiles
    with torch.no_grad():
        times = alternating.alternate(forwards, device, args.rounds, args.seconds)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"{model} forward, {args.rows} rows, {size} px, {dtype}, compile rounding {args.compile_rounding}, {name}")
    for layout, values in times.items():
        print(alternating.rounds_line(f"  {layout:15s}", values))
    ratio = statistics.median(times["batch-major"]) / statistics.median(times["sequence-major"])
    diff = (outputs["sequence-major"] - outputs["batch-major"]).abs().max().item()
    print(f"  batch-major / sequence-major time: {ratio:.4f}; max |output difference| {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
