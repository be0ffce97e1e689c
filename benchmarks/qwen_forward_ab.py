"""The compiled Qwen-Image forward in two or more configurations, A/B on one GPU.

    python benchmarks/qwen_forward_ab.py [--compare layout|table-kernel] [--rows 16] [--size 512]
        [--compile-rounding eager] [--rounds 3]

`--compare layout` (the default): builds the model twice (the same seeded random weights at the
published architecture), compiles one copy with the batch-major baseline
(`compile_adapter(..., sequence_major=False)`, the engine before sequence-major blocks) and the
other as the engine compiles it.

`--compare table-kernel`: one model as the engine compiles it, forwarded four ways: with and
without the per-timestep modulation table (flowrl.accel.qwen_image.modulation; the forward gets
its rows' sigmas from the host, as the engine passes them) and with and without the modulated-norm
kernel (flowrl.accel.qwen_image.modulated_norm): compile_adapter's `modulation_table` and
`norm_kernel` switches, set again before each forward (the compiled graphs stay; those that read a
changed switch retrace once, on the first round).

Compiles every configuration, then times one forward of `--rows` rows (adapter.velocity, as the
engine calls it) of each, alternating A, B, ... for `--rounds` rounds so that clock and
temperature drift hit all alike. Prints ms per forward per round, the median of each, each
median's ratio to the first configuration's, and the largest difference from the first one's
output (bf16 rounding). A CPU run uses the tiny model (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics

import timing
import torch
from floor import velocity_call

from flowrl.accel import compile_adapter
from flowrl.bench.models import build_bench_model
from flowrl.bench.report import quiet_libraries


def _layouts(model, device, dtype, backend, rounding, rows, size) -> dict:
    forwards = {}
    for layout in ("sequence-major", "batch-major"):
        adapter = build_bench_model(model, device, dtype).adapter
        compile_adapter(adapter, backend, rounding, sequence_major=layout == "sequence-major")
        forwards[layout] = velocity_call(adapter, rows, size, size, 1.0)
    return forwards


def _table_kernel(model, device, dtype, backend, rounding, rows, size) -> dict:
    adapter = build_bench_model(model, device, dtype).adapter
    compile_adapter(adapter, backend, rounding)
    forward = velocity_call(adapter, rows, size, size, 1.0, sigma_values=True)

    def configured(table: bool, kernel: bool):
        def run():
            compile_adapter(adapter, backend, rounding, modulation_table=table, norm_kernel=kernel)
            return forward()

        return run

    return {f"table={int(t)} kernel={int(k)}": configured(t, k) for t in (True, False) for k in (True, False)}


COMPARISONS = {"layout": _layouts, "table-kernel": _table_kernel}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=tuple(COMPARISONS), default="layout")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--compile-rounding", default="eager", choices=("eager", "fused"))
    timing.add_arguments(parser, seconds=3.0)
    args = parser.parse_args()
    quiet_libraries()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    model, dtype, backend = (
        ("qwen-image", torch.bfloat16, "inductor") if on_gpu else ("tiny-qwen", torch.float32, "aot_eager")
    )
    size = args.size if on_gpu else 64
    forwards = COMPARISONS[args.compare](model, device, dtype, backend, args.compile_rounding, args.rows, size)
    with torch.no_grad():
        outputs = {name: forward().float() for name, forward in forwards.items()}  # compiles
        times = timing.alternate(forwards, device, args.rounds, args.seconds)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"{model} forward, {args.rows} rows, {size} px, {dtype}, compile rounding {args.compile_rounding}, {name}")
    first = next(iter(forwards))
    for config, values in times.items():
        ratio = statistics.median(values) / statistics.median(times[first])
        diff = (outputs[config] - outputs[first]).abs().max().item()
        print(timing.rounds_line(f"  {config:22s}", values) + f"   x{ratio:.4f}   max |diff| {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
