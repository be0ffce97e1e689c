"""What a Qwen-Image block's training graph keeps for its backward under each activation memory
budget (`trainer.activation_memory_budget`), and what its backward recomputes for it.

    python benchmarks/activation_budget.py [--budgets 1,0.9,0.5,0.1] [--rows 8] [--lora-rank 64]
        [--heads 24 --head-dim 128 --image-tokens 1024 --text-tokens 64] [--device cpu]

For each budget, a fresh copy of one block with the recipe's LoRA (attention and MLP projections,
float32 factors, bf16 autocast, sequence-major as compiled) is traced by torch.compile with grad,
and its joint graph split by AOTAutograd's min-cut partitioner, the one inductor uses, with
inductor's decompositions, under that `activation_memory_budget`. Nothing runs: the split is read
and the compile stopped there, so the full size traces on a CPU in seconds. Prints per budget the
bytes the forward keeps for the backward per call (the block's weights, which are inputs, left
out) and the matrix products (GEMM and attention calls) of the forward and of the backward, with
the GEMMs' TFLOP: a backward with more of them than the default's recomputes products. On a GPU the trainer
measures the same bytes for a whole micro-batch (`memory/activations_per_sample_gb`), after
inductor's own passes over the joint graph, which this leaves out.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch._functorch.config as functorch_config
from qwen_block_variants import add_lora, build_block, inputs
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from flowrl.accel.fused_mlp import fuse_gelu_epilogues
from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image.block import prepare_block

PRODUCTS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


class _Partitioned(Exception):
    """Raised once the joint graph is split: what this script reads is known by then."""


def products(graph: torch.fx.Graph) -> tuple[int, float]:
    """(GEMMs and attention calls, the GEMMs' FLOPs) of a partitioned graph."""
    count, flops = 0, 0.0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target in PRODUCTS:
            a, b = (arg.meta["val"] for arg in node.args[-2:])
            flops += 2.0 * a.shape[:-1].numel() * a.shape[-1] * b.shape[-1]
            count += 1
        elif "attention" in target:
            count += 1
    return count, flops


def kept_bytes(forward: torch.fx.GraphModule) -> int:
    """Bytes of the forward's outputs kept for the backward that are not graph inputs."""
    total = 0
    for node in forward.graph.output_node().args[0]:
        value = getattr(node, "meta", {}).get("val")
        if isinstance(value, torch.Tensor) and node.op != "placeholder":
            total += value.numel() * value.element_size()
    return total


def split(block, kwargs: dict, budget: float, device) -> dict:
    """The partition of `block`'s grad call under `budget`."""
    found = {}

    def partition(joint, joint_inputs, **options):
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **options)
        found.update(kept=kept_bytes(forward), forward=products(forward.graph), backward=products(backward.graph))
        raise _Partitioned

    def backend(graph, example_inputs):
        return aot_module_simplified(
            graph,
            example_inputs,
            fw_compiler=lambda g, _: g.forward,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    try:
        with functorch_config.patch(activation_memory_budget=budget), torch.autocast(device.type, torch.bfloat16):
            compiled(**kwargs)
    except Exception as error:  # dynamo wraps what the backend raises
        if not isinstance(error, _Partitioned) and "_Partitioned" not in repr(error):
            raise
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="1,0.9,0.5,0.1", help="comma-separated budgets in (0, 1]")
    parser.add_argument(
        "--rows", type=int, default=8, help="the Qwen-Image recipe's micro-batch: 4 samples x 2 CFG rows"
    )
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--image-tokens", type=int, default=1024, help="512 px: 1024")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="where the block is built; nothing runs on it")
    args = parser.parse_args()
    device, width = torch.device(args.device), args.heads * args.head_dim
    torch.manual_seed(0)
    base = build_block(args.heads, args.head_dim, device, torch.bfloat16)
    add_lora(base, args.lora_rank, mlp=True)
    options = AccelOptions(sequence_major=True)
    print(
        f"{args.rows} rows x ({args.text_tokens} text + {args.image_tokens} image) tokens, width {width}, "
        f"LoRA rank {args.lora_rank} on the attention and MLP projections, bf16 autocast"
    )
    default = None
    for budget in (float(b) for b in args.budgets.split(",")):
        block = copy.deepcopy(base)
        prepare_block(block, options)
        fuse_gelu_epilogues(block, options)
        kwargs = inputs(
            args.rows,
            args.image_tokens,
            args.text_tokens,
            width,
            args.head_dim,
            "sequence-major",
            device,
            torch.bfloat16,
        )
        for name in ("hidden_states", "encoder_hidden_states"):
            kwargs[name].requires_grad_(True)
        found = split(block, kwargs, budget, device)
        default = default or found
        (fw_count, fw_flops), (bw_count, bw_flops) = found["forward"], found["backward"]
        print(
            f"budget {budget:g}: keeps {found['kept'] / 2**20:.1f} MiB per call "
            f"({found['kept'] / default['kept']:.1%} of the first budget's); forward {fw_count} products "
            f"({fw_flops / 1e12:.3f} TFLOP of GEMMs), backward {bw_count} products ({bw_flops / 1e12:.3f} TFLOP of GEMMs)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
