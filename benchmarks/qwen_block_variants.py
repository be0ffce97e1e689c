"""One full-size Qwen-Image transformer block, compiled as the engine compiles it, in each
activation layout and compile rounding: time per call and where the GPU time goes.

    python benchmarks/qwen_block_variants.py [--rows 16] [--text-tokens 64] [--seconds 2]
        [--variants LAYOUT:ROUNDING[:OPTION=INT...],...] [--code-dir DIR] [--device cuda]

Variants (the same weights; inductor with the family's no-grad options, GELU epilogue, batch dim
dynamic, as `flowrl.accel.compile_adapter` compiles a rollout; by default every layout x rounding):
- layout `batch-major`: diffusers' block forward with the real-RoPE processor (the engine before
  sequence-major blocks); `sequence-major`: flowrl.accel.qwen_image.block's forward, inputs stored
  (L, B, D) as the transformer's input hooks store them;
- rounding `eager` / `fused`: `engine.compile_rounding` (inductor's emulate_precision_casts);
- optional inductor settings on top, for the no-grad and the grad graph, e.g.
  `sequence-major:eager:realize_opcount_threshold=80` or `combo_kernels=1` (0/1 for on/off);
  and compile_adapter's switches (flowrl.accel.options.AccelOptions): `joint_kernel=0`
  (`qk_kernel`) turns off the hand-written q/k norm + RoPE kernel (flowrl.accel.qwen_image.qk_norm_rope) and the
  joint v projection (flowrl.accel.qwen_image.joint_linear) that sequence-major rollout graphs use,
  `joint_v=0` only the latter, `norm_kernel=0` the LayerNorm + modulation and gate + residual
  kernel (flowrl.accel.qwen_image.modulated_norm): A/Bs against inductor's own kernels;
  `lora=R` wraps the block's attention projections in the trainer's rank-R LoRA adapter (the
  recipes' targets, float32 master weights, product in bf16: flowrl.trainer.lora), as a training
  run's rollout compiles them, and `lora_mlp=1` its MLP projections too (the Qwen-Image recipe's
  targets); `lora_fold=0` leaves the low-rank term to inductor instead of
  accumulating it inside the projection's GEMM (flowrl.accel.lora_fold); `lora_first=1` (the
  shipped order, `lora_low_rank_first`) runs the low-rank GEMM first and accumulates the base GEMM
  into it, `lora_first=0` the other way round; `gelu_epilogue=0` runs the MLPs' GELU as a pass of
  its own (with LoRA on the MLP, instead of the folded op with the GELU in its epilogue:
  flowrl.accel.lora_fold.lora_linear_gelu_tanh); `prefix_attention=0` runs a padded batch's
  joint attention as one masked call instead of one call per run of equal text lengths
  (flowrl.accel.qwen_image.prefix_attention; with `--text-mask`); `sdpa=NAME` runs the block's
  SDPA calls with one backend, NAME one of SDPA_BACKENDS (cudnn, flash, efficient, math; flash takes
  no mask, so not with `--text-mask`; cudnn needs a CUDA device), where the default is SDPA's own choice.

Prints ms per block call for each variant, the kernels that take the time (device time per block
call, averaged over `--profile-calls` calls), on a GPU how busy it was over those calls and its
gaps of 0.1 ms or more by the kernel that ended them (with the kernel most often before them, the
host op that launched it, and whether the GPU waited with that kernel queued or for the host to launch it: flowrl.bench.step_profile),
and each variant's largest output difference from the first (bf16 rounding differences; the layouts
are equal in float32 up to the order the attention sums its keys in, tests/accel/test_qwen_block.py). `--text-mask` passes a text mask with half
the rows padded to half their text length, as a CFG batch's short negative prompts make the engine
pass one (flowrl.models.qwen_image), with each row's text length as the adapter passes them. `--launch` times and profiles each variant launched in more
than one way: `direct` (calls back to back, the host free to run ahead, as the engine launches),
`synced` (a device synchronize after each call: the GPU never waits on work queued by a later
call) and `graph` (one call captured as a CUDA graph and replayed; GPU only). On a CPU it runs a
small block as a smoke test.
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path

import torch
from timing import sustained_seconds
from torch._inductor.utils import run_and_get_code
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowrl.accel.fused_mlp import fuse_gelu_epilogues
from flowrl.accel.lora_fold import fold_lora_projections
from flowrl.accel.options import COMPILE_ROUNDINGS as ROUNDINGS
from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image import NO_GRAD_INDUCTOR_OPTIONS
from flowrl.accel.qwen_image.block import prepare_block
from flowrl.accel.qwen_image.prefix_attention import TEXT_LENGTHS_KEY
from flowrl.accel.regional_compile import compile_in_place
from flowrl.bench.flops import synchronize
from flowrl.bench.step_profile import profile_gaps
from flowrl.bench.summary import kernels_after_gaps_text, launch_split_text
from flowrl.models.qwen_image import QwenImageAdapter

LAYOUTS = ("batch-major", "sequence-major")
# --variants sdpa=NAME -> the one SDPA backend the block's attention runs with
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# --variants option -> AccelOptions switch
SWITCHES = {
    "joint_kernel": "qk_kernel",
    "joint_v": "joint_v",
    "norm_kernel": "norm_kernel",
    "lora_fold": "lora_fold",
    "lora_first": "lora_low_rank_first",
    "gelu_epilogue": "gelu_epilogue",
    "prefix_attention": "prefix_attention",
}


def build_block(heads: int, head_dim: int, device, dtype):
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    block = QwenImageTransformerBlock(dim=heads * head_dim, num_attention_heads=heads, attention_head_dim=head_dim)
    return block.to(device, dtype).requires_grad_(False).eval()


def parse_variant(spec: str) -> tuple[str, str, dict]:
    """'layout:rounding[:option=int ...][:sdpa=NAME]' -> (layout, rounding, extra options)."""
    layout, rounding, *options = spec.split(":")
    if layout not in LAYOUTS or rounding not in ROUNDINGS:
        raise SystemExit(
            f"--variants: {spec!r} is not layout:rounding with layout in {LAYOUTS}, rounding in {ROUNDINGS}"
        )
    extra = {}
    for option in options:
        key, _, value = option.partition("=")
        if key == "sdpa" and value not in SDPA_BACKENDS:
            raise SystemExit(f"--variants: sdpa={value!r} in {spec!r} is not one of {', '.join(SDPA_BACKENDS)}")
        extra[key] = value if key == "sdpa" else int(value)
    return layout, rounding, extra


def variant(base, layout: str, rounding: str, backend: str, extra: dict):
    """A copy of `base` switched to `layout` and compiled as the engine compiles it (the Qwen-Image
    family's inductor options, overridden by `extra`, for experiments; the SWITCHES keys and `lora`
    are not inductor options but compile_adapter's switches and the LoRA rank)."""
    block = copy.deepcopy(base)
    extra = dict(extra)
    switches = {name: bool(extra.pop(key)) for key, name in SWITCHES.items() if key in extra}
    options = AccelOptions(sequence_major=layout == "sequence-major", **switches)
    lora_rank = extra.pop("lora", 0)
    lora_mlp = bool(extra.pop("lora_mlp", 0))
    sdpa = extra.pop("sdpa", None)
    if lora_rank:
        add_lora(block, lora_rank, lora_mlp)
    prepare_block(block, options)
    if sdpa is not None:
        with_sdpa_backend(block, SDPA_BACKENDS[sdpa])
    fuse_gelu_epilogues(block, options)
    fold_lora_projections(block, options)
    compile_in_place(block, backend, rounding, NO_GRAD_INDUCTOR_OPTIONS, options=inductor_options(extra))
    return block


_NOT_A_SETTING = object()


def inductor_options(extra: dict) -> dict:
    """The variant's remaining options as inductor settings, each int as the setting's own type
    (`combo_kernels=1` -> True; torch.compile refuses an int for a bool setting)."""
    import torch._inductor.config as inductor_config

    out = {}
    for key, value in extra.items():
        default = inductor_config
        for part in key.split("."):  # nested settings: triton.cudagraphs
            default = getattr(default, part, _NOT_A_SETTING)
        if default is _NOT_A_SETTING:
            raise SystemExit(f"--variants: {key}={value} is neither a switch of this script nor an inductor setting")
        out[key] = bool(value) if isinstance(default, bool) else value
    return out


def with_sdpa_backend(block, backend: SDPBackend) -> None:
    """Run `block`'s forward (and so its compiled graphs, traced inside it) with one SDPA backend."""
    forward = block.forward

    def forward_with_backend(*args, **kwargs):
        with sdpa_kernel(backend):
            return forward(*args, **kwargs)

    block.forward = forward_with_backend


# the MLP projections the Qwen-Image recipe adapts besides the attention's (recipes/qwen_image_ocr_lora.yaml)
MLP_LORA_TARGETS = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def add_lora(block, rank: int, mlp: bool = False) -> None:
    """The trainer's LoRA adapter on the block's attention projections (flowrl.trainer.lora.inject_lora
    on the adapter's default targets), and with `mlp` on its MLP projections too, as the Qwen-Image
    recipe sets it, with nonzero B so that nothing is zero; the same weights in every variant of
    one rank."""
    from flowrl.trainer.lora import inject_lora

    torch.manual_seed(rank)
    inject_lora(block, rank, list(QwenImageAdapter.default_lora_targets) + (MLP_LORA_TARGETS if mlp else []))
    for name, param in block.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param.data, std=1e-3)


def inputs(
    rows: int,
    image_tokens: int,
    text_tokens: int,
    width: int,
    head_dim: int,
    layout: str,
    device,
    dtype,
    text_mask: bool = False,
):
    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    img, txt, temb = rand(rows, image_tokens, width), rand(rows, text_tokens, width), rand(rows, width)
    if layout == "sequence-major":  # (B, L, D) tensors stored (L, B, D), as the input hooks make them
        img, txt = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (img, txt))
    tables = []
    for tokens in (image_tokens, text_tokens):
        angles = torch.rand(tokens, head_dim // 2, generator=gen).to(device) * 6.28
        tables.append(
            (angles.cos().repeat_interleave(2, -1), torch.stack([-angles.sin(), angles.sin()], -1).flatten(-2))
        )
    mask = attention_kwargs = None
    if text_mask:  # the second half of the rows padded to half their text length, as the adapter passes it
        lengths = [text_tokens] * (rows // 2) + [text_tokens // 2] * (rows - rows // 2)
        mask = torch.arange(text_tokens, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        attention_kwargs = {TEXT_LENGTHS_KEY: torch.tensor(lengths)}
    return dict(
        hidden_states=img,
        encoder_hidden_states=txt,
        encoder_hidden_states_mask=mask,
        temb=temb,
        image_rotary_emb=tuple(tables),
        joint_attention_kwargs=attention_kwargs,
    )


LAUNCHES = ("direct", "synced", "graph")


def launched(call, how: str, device):
    """`call` launched as `how` says (module docstring): a function of no arguments."""
    if how == "direct":
        return call
    if how == "synced":

        def synced():
            call()
            synchronize(device)

        return synced
    # graph: warm up on a side stream (as torch.cuda.graph's docs ask), then capture one call
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def kernel_table(call, device, calls: int) -> tuple[list[tuple[str, float, int]], str]:
    """(kernel, ms per block call, launches per block call) of `calls` profiled calls, largest
    first: GPU kernels on a GPU, aten ops (CPU time) on a CPU; and on a GPU a line on how busy it
    was over those calls and its long gaps ('' on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        for _ in range(calls):
            call()
        if on_gpu:
            torch.cuda.synchronize(device)
    rows = []
    for e in prof.key_averages():
        if on_gpu and e.device_type == DeviceType.CUDA:
            rows.append((e.key, e.self_device_time_total / 1e3 / calls, e.count // calls))
        elif not on_gpu and e.key.startswith("aten::"):
            rows.append((e.key, e.self_cpu_time_total / 1e3 / calls, e.count // calls))
    return sorted(rows, key=lambda r: -r[1]), (_gaps_line(prof.events()) if on_gpu else "")


def _gaps_line(events) -> str:
    """How busy the GPU was over the profiled calls and its gaps of 0.1 ms or more (module docstring)."""
    r = profile_gaps(events, top=4)
    if r is None:
        return "no kernels recorded"
    long_gaps = kernels_after_gaps_text(r["kernels_after_long_gaps_ms"]) or "; no gap of 0.1 ms or more"
    return f"GPU busy {r['gpu_busy']:.1%}{long_gaps}{launch_split_text(r['long_gaps_by_launch'])}"


def print_kernels(kernels: list[tuple[str, float, int]], top: int, gaps: str) -> None:
    """`kernel_table`'s largest `top` kernels, a line each, then its gaps line (if any)."""
    for name, ms, count in kernels[:top]:
        print(f"    {ms:7.3f} ms  x{count:<3d} {name[:110]}")
    if gaps:
        print(f"    {gaps}")


def add_block_arguments(parser: argparse.ArgumentParser, rows: int, variants: str) -> None:
    """The block's shape, its variants and the device: the arguments this script shares with
    qwen_train_block.py."""
    parser.add_argument("--rows", type=int, default=rows, help=f"batch rows (default {rows})")
    parser.add_argument("--image-tokens", type=int, default=1024, help="512 px: 1024")
    parser.add_argument("--text-tokens", type=int, default=64, help="flowrl bench's qwen-image prompts: 64")
    parser.add_argument(
        "--variants",
        default=variants,
        help="comma-separated layout:rounding[:option=int...] (this script's docstring lists the options)",
    )
    parser.add_argument(
        "--text-mask", action="store_true", help="pass a text mask with padded rows (as a CFG batch makes the engine)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def compiled_variants(args):
    """(spec, compiled block, its inputs) for each of `args.variants`, one at a time, after the
    run's header line; on a CPU a small float32 block under aot_eager (a smoke run)."""
    device = torch.device(args.device)
    dtype, backend = (torch.bfloat16, "inductor") if device.type == "cuda" else (torch.float32, "aot_eager")
    heads, head_dim = 24, 128
    if device.type == "cpu":  # a smoke run: small widths
        heads, head_dim, args.image_tokens, args.text_tokens = 4, 32, 64, 8
    torch.manual_seed(0)
    base = build_block(heads, head_dim, device, dtype)
    print(
        f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
        f"{args.rows} rows x ({args.text_tokens} text + {args.image_tokens} image) tokens, width {heads * head_dim}"
    )
    for spec in args.variants.split(","):
        layout, rounding, extra = parse_variant(spec)
        block = variant(base, layout, rounding, backend, extra)
        kwargs = inputs(
            args.rows,
            args.image_tokens,
            args.text_tokens,
            heads * head_dim,
            head_dim,
            layout,
            device,
            dtype,
            args.text_mask,
        )
        yield spec, block, kwargs
        del block, kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_block_arguments(parser, rows=16, variants=",".join(f"{lay}:{r}" for lay in LAYOUTS for r in ROUNDINGS))
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    parser.add_argument("--profile-calls", type=int, default=5, help="block calls profiled per variant")
    parser.add_argument(
        "--launch",
        default="direct",
        help=f"comma-separated ways to launch each variant, of {LAUNCHES} (module docstring; default direct)",
    )
    parser.add_argument("--code-dir", help="write each variant's inductor-generated code here (GPU: Triton kernels)")
    args = parser.parse_args()
    device = torch.device(args.device)
    launches = args.launch.split(",")
    for how in launches:
        if how not in LAUNCHES or (how == "graph" and device.type != "cuda"):
            raise SystemExit(f"--launch: {how!r} is not one of {LAUNCHES} ('graph' needs a CUDA device)")
    reference = None
    for spec, block, kwargs in compiled_variants(args):
        with torch.no_grad():
            call = functools.partial(block, **kwargs)
            first, code = run_and_get_code(call)  # the first call compiles
            out = torch.cat([t.float().flatten() for t in first])
            if args.code_dir:
                Path(args.code_dir).mkdir(parents=True, exist_ok=True)
                Path(args.code_dir, spec.replace(":", "-").replace("=", "") + ".py").write_text("\n\n".join(code))
            timed = []
            for how in launches:
                run = launched(call, how, device)
                seconds = sustained_seconds(run, device, args.seconds)["seconds"]
                timed.append((how, seconds, *kernel_table(run, device, args.profile_calls)))
        reference = out if reference is None else reference
        diff = (out - reference).abs().max().item()
        print(f"\n{spec}   max |out - first| {diff:.3g}")
        for how, seconds, kernels, gaps in timed:
            print(
                f"  {how:7s} {seconds * 1e3:8.3f} ms per block call; {sum(ms for _, ms, _ in kernels):7.3f} ms in "
                f"{sum(n for *_, n in kernels)} kernels per call, of which:"
            )
            print_kernels(kernels, args.top, gaps)
        del block
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
