"""What one merge of `rollout.merge_lora` costs (flowrl.trainer.lora_merge): the adapter merged
into a copy of every adapted weight, eager and compiled, against its parts.

    python benchmarks/lora_merge_time.py [--model qwen-image] [--rank 64] [--seconds 2] [--dtype D] [--device cuda]

On the named architecture at random weights with the Qwen-Image recipe's LoRA targets, it prints
the seconds of one whole merge (made and dropped, as a training rollout does) with noise drawn from
a generator (merged_lora's eager rounding) and with hashed noise in one compiled kernel per layer
(`compiled=True`, what the trainer does with engine.compile), of the hashed rounding run eagerly,
of the float32 s B A products alone (flowrl.trainer.lora.adapter_delta, every layer), and the bytes
the merge must move at least (s B A written and read in float32, W read and
W' written in its dtype) at the device's copy rate measured here. On a CPU it runs the tiny model
as a smoke run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from timing import sustained_seconds

from flowrl.bench.flops import synchronize
from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.config.loading import load_config
from flowrl.trainer.lora import adapter_delta
from flowrl.trainer.lora_merge import mergeable_layers, merged_lora, round_merge_hashed, rounding_keys

# The recipe whose LoRA targets the merge adapts (its file is their one home).
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "qwen_image_ocr_lora.yaml"


def copy_bytes_per_second(device: torch.device, seconds: float) -> float:
    """The device's rate of a large tensor copy, bytes read and written."""
    source = torch.empty(1 << 28, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    timed = sustained_seconds(lambda: target.copy_(source), device, seconds)
    return 2 * source.numel() * source.element_size() / timed["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="named architecture (default: qwen-image, tiny-qwen on a CPU)")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (the Qwen-Image recipe's: 64)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per figure")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on a GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = args.model or ("qwen-image" if device.type == "cuda" else "tiny-qwen")
    transformer = build_bench_model(model, device, dtype).adapter.transformer
    make_trainable(transformer, args.rank, load_config(str(RECIPE)).trainer.lora.target_modules)
    with torch.no_grad():  # B away from zero, as after some training
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-4)
    layers = mergeable_layers(transformer)
    entries = sum(layer.base_layer.weight.numel() for layer in layers)
    itemsize = layers[0].base_layer.weight.element_size()
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {model}, {dtype}")
    print(f"{len(layers)} adapted layers, {entries / 1e9:.2f} G weight entries, LoRA rank {args.rank}")

    def merge(compiled: bool) -> None:
        with merged_lora(transformer, seed=0, compiled=compiled):
            pass

    def deltas() -> None:
        with torch.no_grad():
            for layer in layers:
                adapter_delta(layer)

    least_bytes = entries * (2 * 4 + 2 * itemsize)
    rate = copy_bytes_per_second(device, args.seconds)
    print(
        f"  least traffic {least_bytes / 1e9:.1f} GB: {least_bytes / rate:.3f} s at {rate / 1e12:.2f} TB/s (a copy's rate)"
    )

    def hashed_eager() -> None:
        with torch.no_grad():
            for number, layer in enumerate(layers):
                weight = layer.base_layer.weight
                keys = rounding_keys(0, number).to(device)
                round_merge_hashed(adapter_delta(layer).view(-1), weight.view(-1), keys)

    for label, fn in (
        ("s B A products alone (float32)", deltas),
        ("merge, drawn noise (eager)", lambda: merge(False)),
        ("merge, hashed noise compiled", lambda: merge(True)),
        ("merge, hashed noise eager", hashed_eager),
    ):
        timed = sustained_seconds(fn, device, args.seconds)
        print(f"  {label:32s} {timed['seconds']:.3f} s ({timed['calls']} calls)")
    synchronize(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
