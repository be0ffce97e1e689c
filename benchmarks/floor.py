"""How fast one transformer forward could be at all, from its own matmuls and attention.

    python benchmarks/floor.py --model {qwen-image|sd35-medium|PATH|tiny-qwen|tiny-sd3} [-n 16] [--steps 50]
        [--size 512] [--guidance-scale 4.0] [--compile] [--seconds 3] [--json F]

A rollout step is one transformer forward at B rows. This script records that forward once
(eager, at the benchmark's batch and image size), then times, back to back on the real weights:

- `linears`: every nn.Linear call of the forward, in order (cuBLAS, as the model runs them);
- `linears-fused`: the same, with the projections that read the same input (q, k, v of one
  stream) merged into one GEMM of concatenated weights;
- `attention`: every attention kernel call, with the same shapes, strides and kernel;
- `forward`: the whole forward (`adapter.velocity`), eager, and compiled with `--compile`.

floor = best linears + attention: the forward's time if everything between the matmuls (norms,
modulation, RoPE, activations, residuals) were free. `forward - floor` is what fusion could still
win; `floor` against the rollout target says whether a target is reachable with these GEMMs at
all. Each figure is sustained: repeated for about `--seconds` after a warm-up, as a rollout runs
(timing.sustained_seconds). `--model` and the other common options are `flowrl bench`'s.
A CPU test checks that the recorded calls carry all of the forward's FLOPs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
from timing import sustained_seconds
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl.bench import flops as flop_count
from flowrl.bench.cli import add_common_arguments, add_compile_arguments, positive_int
from flowrl.bench.models import build_bench_model
from flowrl.bench.report import JsonReport, environment, format_table, quiet_libraries, resolve_device_dtype
from flowrl.bench.rollout import PROMPT


@dataclass
class LinearCall:
    module: torch.nn.Linear
    rows: int  # product of the input's leading dims
    input_key: tuple  # (data_ptr, shape): calls with the same key read the same tensor

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.module.in_features * self.module.out_features


@dataclass
class AttentionCall:
    op: object  # the aten overload the model dispatched (cuDNN, flash, efficient, CPU flash)
    args: tuple  # tensors replaced by (shape, stride, dtype) specs
    kwargs: dict
    flops: int


@dataclass
class ForwardRecord:
    linears: list[LinearCall] = field(default_factory=list)
    attention: list[AttentionCall] = field(default_factory=list)


def _is_attention_op(op) -> bool:
    name = str(op)
    return "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name


class _AttentionRecorder(TorchDispatchMode):
    """Records attention kernels (below autograd, so the backend SDPA chose) without changing them."""

    def __init__(self, record: ForwardRecord):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_attention_op(func):
            q, k, v = args[:3]
            *batch, lq, d = q.shape
            heads = 1
            for size in batch:
                heads *= size
            spec = tuple(
                ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a
                for a in args
            )
            flops = 2 * heads * lq * k.shape[-2] * (d + v.shape[-1])
            self.record.attention.append(AttentionCall(func, spec, dict(kwargs), flops))
        return func(*args, **kwargs)


@torch.no_grad()
def record_forward(adapter, rows: int, height: int, width: int, guidance_scale: float) -> ForwardRecord:
    """Run one eager forward of `rows` rows (cond + uncond rows when guidance_scale > 1) and record
    every Linear call and attention kernel in order."""
    record = ForwardRecord()

    def on_linear(module, inputs):
        x = inputs[0]
        record.linears.append(LinearCall(module, x.numel() // x.shape[-1], (x.data_ptr(), tuple(x.shape))))

    linears = [m for m in adapter.transformer.modules() if type(m) is torch.nn.Linear]
    handles = [m.register_forward_pre_hook(on_linear) for m in linears]
    try:
        forward = velocity_call(adapter, rows, height, width, guidance_scale)
        with _AttentionRecorder(record):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return record


def velocity_call(adapter, rows: int, height: int, width: int, guidance_scale: float, sigma_values: bool = False):
    """adapter.velocity over `rows` transformer rows (rows/2 samples with CFG); with sigma_values,
    the rows' sigmas are passed from the host too, as the engine passes them."""
    cfg = guidance_scale > 1.0
    samples = rows // 2 if cfg else rows
    cond = adapter.encode_prompts([PROMPT] * samples)
    uncond = adapter.encode_prompts([""] * samples) if cfg else [None] * samples
    gen = torch.Generator(device=adapter.device).manual_seed(0)
    latents = torch.randn((samples, *adapter.latent_shape(height, width)), device=adapter.device, generator=gen)
    sigmas = torch.full((samples,), 0.5, device=adapter.device)
    guidance = torch.full((samples,), guidance_scale, device=adapter.device)
    host = [0.5] * samples if sigma_values else None
    return lambda: adapter.velocity(latents, sigmas, cond, uncond, guidance, height, width, sigma_values=host)


def _linear_replay(record: ForwardRecord, fused: bool, device, dtype):
    """A callable that runs the recorded Linear calls on the real weights (inputs: random buffers of
    the recorded shapes); with fused=True, consecutive calls on one input become one GEMM."""
    groups: list[list[LinearCall]] = []
    for call in record.linears:
        if fused and groups and groups[-1][0].input_key == call.input_key:
            groups[-1].append(call)
        else:
            groups.append([call])
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    plan = []
    for group in groups:
        rows, k = group[0].rows, group[0].module.in_features
        if (rows, k) not in inputs:
            inputs[(rows, k)] = torch.randn((rows, k), device=device, dtype=dtype)
        if len(group) == 1:
            weight, bias = group[0].module.weight, group[0].module.bias
        else:  # concatenated once, outside the timed region (the cost a fused model pays at load)
            weight = torch.cat([c.module.weight for c in group])
            biases = [c.module.bias for c in group]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
        plan.append((inputs[(rows, k)], weight, bias))

    def run():
        for x, weight, bias in plan:
            torch.nn.functional.linear(x, weight, bias)

    return run, len(plan)


def _attention_replay(record: ForwardRecord, device):
    calls = []
    for call in record.attention:
        args = []
        for a in call.args:
            if isinstance(a, tuple) and a and a[0] == "tensor":
                _, shape, stride, dtype = a
                t = torch.empty_strided(shape, stride, device=device, dtype=dtype)
                t.copy_(
                    torch.randn(shape, device=device, dtype=torch.float32)
                ) if dtype.is_floating_point else t.zero_()
                args.append(t)
            else:
                args.append(a)
        calls.append((call.op, tuple(args), call.kwargs))

    def run():
        for op, args, kwargs in calls:
            op(*args, **kwargs)

    return run


def run_floor(args: argparse.Namespace) -> int:
    quiet_libraries()
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    bench = build_bench_model(args.model, device, dtype, num_layers=args.num_layers)
    adapter = bench.adapter
    rows = args.num_samples * (2 if args.guidance_scale > 1.0 else 1)
    report = JsonReport(
        args.json,
        {
            "benchmark": "floor",
            "environment": environment(device),
            "settings": {
                "model": args.model,
                "family": bench.family,
                "dtype": str(dtype).replace("torch.", ""),
                "num_samples": args.num_samples,
                "rows": rows,
                "size": args.size,
                "steps": args.steps,
                "guidance_scale": args.guidance_scale,
                "seconds": args.seconds,
                "compile": args.compile,
                "compile_rounding": args.compile_rounding,
            },
            "parts": {},
        },
    )
    peak = flop_count.measure_matmul_peak(device, dtype, sustain_seconds=args.peak_seconds)
    report.data["peak"] = peak
    record = record_forward(adapter, rows, args.size, args.size, args.guidance_scale)
    forward = velocity_call(adapter, rows, args.size, args.size, args.guidance_scale)
    linear_flops = sum(c.flops for c in record.linears)
    attention_flops = sum(c.flops for c in record.attention)
    parts = report.data["parts"]

    def measure(name: str, fn, flops: int | None, **extra) -> None:
        with torch.no_grad():
            timing = sustained_seconds(fn, device, args.seconds)
        parts[name] = {
            **timing,
            "flops": flops,
            **extra,
            "flop_per_second": flops / timing["seconds"] if flops else None,
        }
        report.save()
        rate = f", {flops / timing['seconds'] / 1e12:.1f} TFLOP/s" if flops else ""
        print(f"[bench] {name}: {timing['seconds'] * 1e3:.2f} ms per forward{rate}", flush=True)

    for fused in (False, True):
        replay, gemms = _linear_replay(record, fused, device, dtype)
        measure("linears-fused" if fused else "linears", replay, linear_flops, gemms=gemms)
        del replay
    measure(
        "attention",
        _attention_replay(record, device),
        attention_flops,
        calls=len(record.attention),
        kernel=str(record.attention[0].op) if record.attention else None,
    )
    measure("forward", forward, None)
    if args.compile:
        from flowrl.accel import compile_adapter

        compile_adapter(adapter, args.compile_backend, args.compile_rounding)
        measure("forward-compiled", forward, None)
    floor = min(parts["linears"]["seconds"], parts["linears-fused"]["seconds"]) + parts["attention"]["seconds"]
    per_image = args.steps * (rows / args.num_samples)  # forwards' worth of rows per image
    report.data["floor"] = {
        "seconds_per_forward": floor,
        "images_per_second_transformer_only": args.num_samples / (args.steps * floor),
        "rows_per_forward": rows,
        "forward_rows_per_image": per_image,
    }
    report.save()
    _print(report.data)
    return 0


def _print(data: dict) -> None:
    s, parts, floor = data["settings"], data["parts"], data["floor"]
    print()
    print(
        f"== floor: {s['model']}, {s['rows']} rows per forward, {s['size']}px, {s['dtype']}, "
        f"{data['environment'].get('gpu') or data['environment']['device']}; matmul peak "
        f"{data['peak']['sustained_flops'] / 1e12:.1f} TFLOP/s sustained"
    )
    rows = []
    for name, p in parts.items():
        rate = p["flop_per_second"] / 1e12 if p.get("flop_per_second") else None
        share = p["flop_per_second"] / data["peak"]["sustained_flops"] if p.get("flop_per_second") else None
        rows.append([name, p["seconds"] * 1e3, rate, f"{share:.1%}" if share else "-", p["calls"]])
    print(format_table(["part", "ms/forward", "TFLOP/s", "of peak", "timed calls"], rows))
    print(
        f"   floor (best linears + attention): {floor['seconds_per_forward'] * 1e3:.2f} ms per forward -> "
        f"at most {floor['images_per_second_transformer_only']:.3f} img/s over {s['steps']} steps, VAE decode excluded"
    )
    for name in ("forward", "forward-compiled"):
        if name in parts:
            print(
                f"   {name} - floor: {(parts[name]['seconds'] - floor['seconds_per_forward']) * 1e3:.2f} ms "
                f"({parts[name]['seconds'] / floor['seconds_per_forward']:.3f} x floor)"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument(
        "-n", "--num-samples", type=positive_int, default=16, help="samples per forward (rows: 2x with CFG; default 16)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="sustained timing per part (default 3 s)")
    add_compile_arguments(parser, "also time the forward after regional torch.compile")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compile_rounding != "eager" and not args.compile:
        parser.error(f"--compile-rounding={args.compile_rounding} applies to compiled runs only; add --compile")
    return run_floor(args)


if __name__ == "__main__":
    sys.exit(main())
