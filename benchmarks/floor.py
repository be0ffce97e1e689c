"""How fast one transformer forward, or one training forward + backward, could be at all, from
its own matrix products and attention.

    python benchmarks/floor.py --model {qwen-image|sd35-medium|PATH|tiny-qwen|tiny-sd3} [-n 16] [--steps 50]
        [--size 512] [--guidance-scale 4.0] [--max-sequence-length L] [--lora-rank R [--lora-targets a,b,...]] [--train]
        [--compile] [--seconds 3] [--json F]

A rollout step is one transformer forward at B rows, a training micro-batch one forward with grad
and its backward. This script records that forward once (eager, at the benchmark's batch and image
size, with the trainer's LoRA adapter when `--lora-rank` is given), then times, back to back on
the real weights:

- `linears`: every nn.Linear call of the forward, in order (cuBLAS, as the model runs them; a LoRA
  layer's base projection included);
- `linears-fused`: the same, with the projections that read the same input (q, k, v of one
  stream) merged into one GEMM of concatenated weights;
- `attention`: every attention kernel call, with the same shapes, strides and kernel;
- `lora`: each LoRA layer's two factor GEMMs, the second accumulating into the output;
- with `--train` (floor_train.py): `linears-backward` (and `-fused`), each Linear's input and
  weight gradients where autograd computes them; `attention-train`, each attention forward and
  backward; `lora-backward`, the LoRA factors' four backward GEMMs;
- `forward`: the whole forward (`adapter.velocity`), eager, and compiled with `--compile`.

floor = best linears + attention: the forward's time if everything between the matmuls (norms,
modulation, RoPE, activations, residuals) were free. `forward - floor` is what fusion could still
win; `floor` against the rollout target says whether a target is reachable with these GEMMs at
all. The last table gives each pass's floor (forward; forward + LoRA; training, forward and
backward; training + LoRA) against its limit, its FLOPs at the matmul peak measured in the same
run: `flowrl bench train` reports each phase's time over the same kind of limit. Each figure is
sustained: repeated for about `--seconds` after a warm-up, as a rollout runs
(timing.sustained_seconds). `--model` and the other common options are `flowrl bench`'s.
CPU tests check that the recorded calls carry all of the forward's FLOPs, and that the training
replays carry every matrix product of the backward autograd runs at the trainer's setup.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from dataclasses import dataclass, field

import floor_train
import torch
from timing import sustained_seconds
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.bench.report import JsonReport, environment, format_table, quiet_libraries, resolve_device_dtype
from flowrl.bench.rollout import PROMPT
from flowrl.cli.bench import add_common_arguments, add_compile_arguments, positive_int
from flowrl.run import flops as flop_count


@dataclass
class LinearCall:
    module: torch.nn.Linear
    rows: int  # product of the input's leading dims
    input_key: int  # calls with one key read one tensor (consecutive calls only)
    input_requires_grad: bool = False  # recorded with grad on
    output_used: bool = True  # recorded with grad on: the velocity depends on the output, so a backward reaches it

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.module.in_features * self.module.out_features


@dataclass
class AttentionCall:
    op: object  # the aten overload the model dispatched (cuDNN, flash, efficient, CPU flash)
    args: tuple  # tensors replaced by floor_train.tensor_spec
    kwargs: dict
    flops: int


@dataclass
class ForwardRecord:
    linears: list[LinearCall] = field(default_factory=list)  # base Linears (a LoRA layer's own included)
    attention: list[AttentionCall] = field(default_factory=list)  # aten attention kernels (without grad)
    lora: list[floor_train.LoraCall] = field(default_factory=list)  # LoRA-adapted Linears
    sdpa: list[floor_train.SdpaCall] = field(default_factory=list)  # F.scaled_dot_product_attention (with grad)


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
            spec = tuple(floor_train.tensor_spec(a) if isinstance(a, torch.Tensor) else a for a in args)
            flops = flop_count.attention_flops(q.shape, k.shape, v.shape)
            self.record.attention.append(AttentionCall(func, spec, dict(kwargs), flops))
        return func(*args, **kwargs)


def record_forward(
    adapter, rows: int, height: int, width: int, guidance_scale: float, grad: bool = False
) -> ForwardRecord:
    """Run one eager forward of `rows` rows (cond + uncond rows when guidance_scale > 1) and record
    every Linear call, LoRA layer and attention call in order: without grad, the attention kernels
    below autograd; with grad (as the trainer's forward runs, activations not kept), which inputs
    require grad and every F.scaled_dot_product_attention call, for the backward's replay."""
    record = ForwardRecord()
    latest, outputs = {}, []  # each module's call in progress; (call, its output's autograd node)
    previous = {"input": lambda: None, "key": -1}  # the last Linear's input (a weak reference) and key

    def input_key(x: torch.Tensor) -> int:
        # The same tensor object as the last Linear's input; an address would not do, since the
        # caching allocator hands a freed input's memory to the next one.
        key = previous["key"] if previous["input"]() is x else previous["key"] + 1
        previous.update(input=weakref.ref(x), key=key)
        return key

    def on_linear(module, inputs):
        x = inputs[0]
        latest[module] = LinearCall(module, x.numel() // x.shape[-1], input_key(x), x.requires_grad)
        record.linears.append(latest[module])

    def on_lora(module, inputs):
        x = inputs[0]
        latest[module] = floor_train.LoraCall(module, x.numel() // x.shape[-1], x.requires_grad)
        record.lora.append(latest[module])

    def on_output(module, inputs, output):
        outputs.append((latest[module], output.grad_fn))

    modules = [m for n, m in adapter.transformer.named_modules() if "lora_" not in n]
    linears = [m for m in modules if type(m) is torch.nn.Linear]
    loras = [m for m in modules if floor_train.is_lora_linear(m)]
    handles = [m.register_forward_pre_hook(on_linear) for m in linears]
    handles += [m.register_forward_pre_hook(on_lora) for m in loras]
    if grad:
        handles += [m.register_forward_hook(on_output) for m in linears + loras]
    forward = velocity_call(adapter, rows, height, width, guidance_scale)
    try:
        if grad:
            # The forward's graph is built as the trainer builds it, but keeps no activations.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda _: None, lambda _: None):
                with floor_train.SdpaRecorder(record.sdpa):
                    velocity = forward()
            floor_train.mark_used_outputs(outputs, velocity)
        else:
            with torch.no_grad(), _AttentionRecorder(record):
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


def _linear_groups(record: ForwardRecord, fused: bool) -> list[tuple[list[LinearCall], torch.Tensor, object]]:
    """(calls, weight, bias) per GEMM: one call each, or with fused=True the consecutive calls on
    one input as one GEMM of concatenated weights (concatenated once, outside the timed region:
    the cost a fused model pays at load)."""
    groups: list[list[LinearCall]] = []
    for call in record.linears:
        if fused and groups and groups[-1][0].input_key == call.input_key:
            groups[-1].append(call)
        else:
            groups.append([call])
    out = []
    for group in groups:
        if len(group) == 1:
            weight, bias = group[0].module.weight, group[0].module.bias
        else:
            weight = torch.cat([c.module.weight for c in group])
            biases = [c.module.bias for c in group]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
        out.append((group, weight, bias))
    return out


def _linear_replay(groups, device, dtype):
    """A callable that runs the grouped Linear calls on the real weights (inputs: random buffers of
    the recorded shapes)."""
    inputs = floor_train.Buffers(device, dtype)
    plan = [(inputs(calls[0].rows, calls[0].module.in_features), weight, bias) for calls, weight, bias in groups]

    def run():
        for x, weight, bias in plan:
            torch.nn.functional.linear(x, weight, bias)

    return run, len(plan)


def _attention_replay(record: ForwardRecord, device):
    calls = [
        (call.op, tuple(floor_train.materialize(a, device) for a in call.args), call.kwargs)
        for call in record.attention
    ]

    def run():
        for op, args, kwargs in calls:
            op(*args, **kwargs)

    return run


def run_floor(args: argparse.Namespace) -> int:
    quiet_libraries()
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    bench = build_bench_model(args.model, device, dtype, args.num_layers, args.max_sequence_length)
    adapter = bench.adapter
    targets = args.lora_targets.split(",") if args.lora_targets else list(adapter.default_lora_targets)
    if args.lora_rank > 0 or args.train:
        make_trainable(adapter.transformer, args.lora_rank, targets)
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
                "max_sequence_length": args.max_sequence_length,
                "text_tokens": getattr(adapter, "text_tokens", None),
                "lora_rank": args.lora_rank,
                "lora_targets": targets if args.lora_rank > 0 else None,
                "train": args.train,
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

    groups = {fused: _linear_groups(record, fused) for fused in (False, True)}
    for fused, grouped in groups.items():
        measure(
            "linears-fused" if fused else "linears",
            _linear_replay(grouped, device, dtype)[0],
            linear_flops,
            gemms=len(grouped),
        )
    measure(
        "attention",
        _attention_replay(record, device),
        attention_flops,
        calls=len(record.attention),
        kernel=str(record.attention[0].op) if record.attention else None,
    )
    if record.lora:
        lora_forward, _ = floor_train.lora_replays(record.lora, device, dtype)
        measure("lora", lora_forward, sum(c.forward_flops for c in record.lora), layers=len(record.lora))
    if args.train:
        measure_training(args, adapter, rows, groups, measure, device, dtype)
        del groups
    measure("forward", forward, None)
    if args.compile:
        from flowrl.accel import compile_adapter

        compile_adapter(adapter, args.compile_backend)
        measure("forward-compiled", forward, None)
    floor = min(parts["linears"]["seconds"], parts["linears-fused"]["seconds"]) + parts["attention"]["seconds"]
    per_image = args.steps * (rows / args.num_samples)  # forwards' worth of rows per image
    report.data["floor"] = {
        "seconds_per_forward": floor,
        "images_per_second_transformer_only": args.num_samples / (args.steps * floor),
        "rows_per_forward": rows,
        "forward_rows_per_image": per_image,
    }
    report.data["floors"] = floors(parts, peak["sustained_flops"])
    report.save()
    _print(report.data)
    return 0


def measure_training(args, adapter, rows: int, groups: dict, measure, device, dtype) -> None:
    """The training pass's own parts: each Linear's backward GEMMs (unfused and fused as the
    forward's), the attention's forward + backward and the LoRA factors' backward GEMMs, from one
    forward recorded with grad at the trainer's setup."""
    grad_record = record_forward(adapter, rows, args.size, args.size, args.guidance_scale, grad=True)
    calls = [c for grouped, _, _ in groups[False] for c in grouped]
    if [c.module for c in calls] != [c.module for c in grad_record.linears]:
        raise RuntimeError("the forward with grad made other Linear calls than the one without; cannot pair them")
    for call, with_grad in zip(calls, grad_record.linears, strict=True):
        call.input_requires_grad, call.output_used = with_grad.input_requires_grad, with_grad.output_used
    for fused, grouped in groups.items():
        replay, gemms, flops = floor_train.linear_backward_replay(
            [(calls, weight) for calls, weight, _ in grouped], device, dtype
        )
        measure("linears-backward-fused" if fused else "linears-backward", replay, flops, gemms=gemms)
    measure(
        "attention-train",
        floor_train.attention_train_replay(grad_record.sdpa, device),
        3 * sum(c.forward_flops for c in grad_record.sdpa),
        calls=len(grad_record.sdpa),
    )
    if grad_record.lora:
        _, lora_backward = floor_train.lora_replays(grad_record.lora, device, dtype)
        measure("lora-backward", lora_backward, sum(c.backward_flops for c in grad_record.lora))


def floors(parts: dict, peak_flops: float) -> dict:
    """Each pass's floor (its matrix products alone, the faster of unfused and fused Linears),
    its FLOPs, its limit (those FLOPs at the matmul peak) and floor / limit."""

    def best(name: str) -> dict:
        return min(parts[name], parts[name + "-fused"], key=lambda p: p["seconds"])

    passes = {"forward": [best("linears"), parts["attention"]]}
    if "lora" in parts:
        passes["forward + LoRA"] = passes["forward"] + [parts["lora"]]
    if "attention-train" in parts:
        passes["training"] = [best("linears"), best("linears-backward"), parts["attention-train"]]
        if "lora-backward" in parts:
            passes["training + LoRA"] = passes["training"] + [parts["lora"], parts["lora-backward"]]
    out = {}
    for name, members in passes.items():
        seconds = sum(p["seconds"] for p in members)
        flops = sum(p["flops"] for p in members)
        limit = flops / peak_flops
        out[name] = {"seconds": seconds, "flops": flops, "limit_seconds": limit, "floor_over_limit": seconds / limit}
    return out


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
    print()
    print(
        format_table(
            ["pass", "TFLOP", "limit ms", "floor ms", "floor / limit"],
            [
                [name, f["flops"] / 1e12, f["limit_seconds"] * 1e3, f["seconds"] * 1e3, f"{f['floor_over_limit']:.3f}"]
                for name, f in data["floors"].items()
            ],
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument(
        "-n", "--num-samples", type=positive_int, default=16, help="samples per forward (rows: 2x with CFG; default 16)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="sustained timing per part (default 3 s)")
    parser.add_argument(
        "--max-sequence-length",
        type=positive_int,
        default=None,
        help="the text length, as a recipe's model.max_sequence_length (default: the family's)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="the trainer's LoRA adapter of this rank on --lora-targets (default 0: none; with --train, "
        "0 trains the full transformer, as trainer.lora.enabled=false)",
    )
    parser.add_argument(
        "--lora-targets", default=None, help="comma-separated trainer.lora.target_modules (default: the family's)"
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="also replay the training pass's backward products: Linear input and weight gradients, "
        "attention forward + backward, the LoRA factors' gradients",
    )
    add_compile_arguments(parser, "also time the forward after regional torch.compile")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lora_rank < 0:
        parser.error(f"--lora-rank={args.lora_rank} must be >= 0 (0: no adapter, or with --train the full transformer)")
    if args.lora_targets and args.lora_rank == 0:
        parser.error(f"--lora-targets={args.lora_targets} needs --lora-rank > 0")
    return run_floor(args)


if __name__ == "__main__":
    sys.exit(main())
