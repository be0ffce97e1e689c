"""Would CUDA graphs speed up the compiled forward? A/B of one forward launched as usual and the
same forward captured once into a CUDA graph and replayed, on one GPU.

    python benchmarks/cuda_graph_ab.py [--model qwen-image] [--rows 1,16] [--lora-rank 0] [--size 512] [--rounds 3]

Builds the model (seeded random weights at the published architecture), with `--lora-rank` > 0
the trainer's LoRA adapter on the family's default targets (as a training run rolls out), compiles
it as the engine does (`flowrl.accel.compile_adapter`, default rounding), and for each row count
times one forward (adapter.velocity, as the engine calls it) launched kernel by kernel, then the
same forward replayed from a CUDA graph captured after warm-up, alternating for `--rounds` rounds
so that clock drift hits both alike. The replay runs the very kernels of the direct call, so the
difference is what launching costs on the GPU: the gaps between kernels, and host time where the
host cannot keep ahead. Prints ms per forward per round, the medians, their ratio and the largest difference
between the two outputs (0 expected). On a CPU the tiny model runs the direct forward only (a
smoke test: CUDA graphs need a GPU).
"""

from __future__ import annotations

import argparse
import statistics

import timing
import torch
from floor import velocity_call

from flowrl.accel import compile_adapter
from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.bench.report import quiet_libraries


def captured(forward):
    """(replay, output): forward captured into a CUDA graph after two warm-up calls on a side stream
    (as torch.cuda.graphs asks); replay() reruns it and rewrites `output` in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    return graph.replay, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-image", help="qwen-image or sd35-medium (a GPU run)")
    parser.add_argument("--rows", default="1,16", help="comma-separated row counts")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--lora-rank", type=int, default=0, help="the trainer's LoRA at this rank (0: none)")
    timing.add_arguments(parser, seconds=2.0)
    args = parser.parse_args()
    quiet_libraries()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    model = args.model if on_gpu else ("tiny-sd3" if args.model.startswith("sd3") else "tiny-qwen")
    dtype, backend, size = (torch.bfloat16, "inductor", args.size) if on_gpu else (torch.float32, "aot_eager", 64)
    adapter = build_bench_model(model, device, dtype).adapter
    lora = ""
    if args.lora_rank:
        params = make_trainable(adapter.transformer, args.lora_rank, adapter.default_lora_targets)
        lora = f"LoRA rank {args.lora_rank} ({sum(p.numel() for p in params)} parameters), "
    compile_adapter(adapter, backend, "eager")
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"{model} compiled forward, {size} px, {dtype}, {lora}direct launch vs CUDA graph replay, {name}")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            direct = velocity_call(adapter, rows, size, size, 1.0)
            reference = direct().float()  # compiles
            variants = {"direct": direct}
            diff = None
            if on_gpu:
                try:
                    replay, output = captured(direct)
                except Exception as error:  # noqa: BLE001 - report and go on: the direct figure still stands
                    print(f"  rows {rows}: capture failed: {type(error).__name__}: {error}")
                else:
                    replay()
                    diff = (output.float() - reference).abs().max().item()
                    variants["graph"] = replay
            times = timing.alternate(variants, device, args.rounds, args.seconds)
            for variant, values in times.items():
                print(timing.rounds_line(f"  rows {rows:3d} {variant:7s}", values))
            if "graph" in times:
                saved = 1 - statistics.median(times["graph"]) / statistics.median(times["direct"])
                print(
                    f"  rows {rows:3d} graph saves {saved * 100:.2f}% of the direct time; max |output difference| {diff:.3g}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
