"""`flowrl generate`: sample images with the rollout engine, write PNGs, print batching stats.

With -n N the prompt's N samples go through one generate_batched call (shared forwards); several
--prompt flags run concurrently and are batched by the engine as well.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def build_parser(parser):
    parser.add_argument("--model", required=True, help="local diffusers checkpoint folder (SD3/3.5 or Qwen-Image)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several prompts)")
    parser.add_argument("-n", "--num-outputs", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--out", required=True, help="output folder for PNGs and stats.json")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out folder that flowrl generate did not write",
    )
    parser.add_argument("--height", type=int, default=None, help="default: 512 (64 for tiny checkpoints)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 10)")
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--noise-level", type=float, default=0.7, help="SDE noise level; 0 = ODE sampling")
    parser.add_argument("--sde-type", default="sde", choices=["sde", "cps"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-rows", type=int, default=32)


def resolve_device_dtype(device: str, dtype: str):
    """'auto' -> cuda + bfloat16 when a GPU is present, else cpu + float32."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    return device, getattr(torch, dtype)


def run(args) -> int:
    import sys

    from flowrl.engine import DiffusionEngine, SamplingParams
    from flowrl.output_paths import OutputExistsError, check_output_folder, write_marker

    try:
        check_output_folder(args.out, "generate", args.overwrite)
    except OutputExistsError as error:
        print(f"flowrl generate: error: {error}", file=sys.stderr)
        return 2
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    engine = DiffusionEngine.from_pretrained(args.model, device=device, dtype=dtype, max_batch_rows=args.max_batch_rows)
    is_tiny = engine.adapter.transformer.num_parameters() < 10_000_000
    size = 64 if is_tiny else 512
    params = SamplingParams(
        height=args.height or size,
        width=args.width or size,
        num_inference_steps=args.steps or 10,
        guidance_scale=args.guidance_scale,
        negative_prompt=args.negative_prompt,
        noise_level=args.noise_level,
        sde_type=args.sde_type,
        seed=args.seed,
        logprobs=args.noise_level > 0,
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    futures = []
    for i, prompt in enumerate(args.prompt):
        seed = args.seed + i * args.num_outputs
        futures.append((i, prompt, engine.submit_batched(prompt, args.num_outputs, params.replace(seed=seed))))
    from PIL import Image

    written = []
    for i, prompt, group in futures:
        for j, future in enumerate(group):
            output = future.result()
            path = out_dir / f"p{i:03d}_s{j:03d}_seed{output.seed}.png"
            Image.fromarray(output.image.permute(1, 2, 0).numpy()).save(path)
            written.append(str(path))
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.shutdown()
    (out_dir / "stats.json").write_text(json.dumps({"wall_seconds": elapsed, **stats, "images": written}, indent=2))
    write_marker(out_dir, "generate", [Path(name).name for name in written] + ["stats.json"])
    print(f"wrote {len(written)} images to {out_dir} in {elapsed:.2f}s")
    print(
        f"forwards {stats['num_forwards']}, rows {stats['num_rows']}, mean rows/forward "
        f"{stats['mean_rows_per_forward']:.2f}, rows-per-forward histogram {stats['rows_per_forward_hist']}, "
        f"{stats['images_per_second']:.2f} img/s"
    )
    return 0
