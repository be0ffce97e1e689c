"""`flowrl bench rollout`: rollout throughput of the engine against the diffusers pipeline.

One process, one model, one set of settings; the modes (img/s = images / wall seconds, VAE decode
and host copies included, median of --repeats runs after a warm-up run):

- pipeline-serial:   the family's diffusers pipeline at batch 1, called --serial-samples times
- pipeline-batched:  that pipeline at batch N (precomputed prompt embeddings)
- engine-batched:    DiffusionEngine.generate_batched(prompt, N)
- engine-concurrent: N concurrent single requests (engine.submit, different prompts)
- *-compiled:        the same after regional torch.compile of the hot modules (in place, so every
                     eager mode runs first; pipeline-batched-compiled shows compile in the
                     diffusers loop)

The engine samples the way rollouts do (SDE steps with log-probs and stored trajectories); the
pipeline runs its plain ODE loop. FLOPs are counted once per configuration and MFU is reported
against the matmul peak measured in the same run; `limit` is the img/s at that peak.
"""

from __future__ import annotations

import time
import traceback

import torch

from flowrl.bench.models import build_bench_model, make_trainable, pipeline_prompt_kwargs
from flowrl.bench.report import (
    JsonReport,
    environment,
    format_table,
    median,
    peak_memory_gb,
    quiet_libraries,
    reset_peak_memory,
    resolve_device_dtype,
    shape_label,
    time_runs,
)
from flowrl.run import flops as flop_count
from flowrl.sampling_params import SamplingParams

EAGER_MODES = ("pipeline-serial", "pipeline-batched", "engine-batched", "engine-concurrent")
COMPILED_MODES = ("engine-batched-compiled", "engine-concurrent-compiled", "pipeline-batched-compiled")
ALL_MODES = EAGER_MODES + COMPILED_MODES
PROMPT = "a photo of a red bicycle leaning on a white wall"


def resolve_modes(modes: str | None, compile: bool) -> list[str]:
    """The modes to run, eager ones first (compilation happens in place, once, between them)."""
    if modes:
        chosen = [m.strip() for m in modes.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in ALL_MODES]
        if unknown or not chosen:
            raise ValueError(f"--modes={modes!r} has unknown modes {unknown}; choose from {', '.join(ALL_MODES)}")
    else:
        chosen = list(EAGER_MODES) + (["engine-batched-compiled", "engine-concurrent-compiled"] if compile else [])
    return [m for m in ALL_MODES if m in chosen]


def _size(args) -> tuple[int, int, int]:
    """(height, width, num_frames) of the benchmark's samples: --height/--width (default --size),
    --num-frames (video models)."""
    height, width = getattr(args, "height", None) or args.size, getattr(args, "width", None) or args.size
    return height, width, getattr(args, "num_frames", 1)


def _params(args, steps: int) -> SamplingParams:
    height, width, num_frames = _size(args)
    return SamplingParams(
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale,
        noise_level=args.noise_level,
        seed=args.seed,
        logprobs=args.noise_level > 0,
    )


class RolloutBench:
    def __init__(self, args):
        self.args = args
        self.device, self.dtype = resolve_device_dtype(args.device, args.dtype)
        self.bench = build_bench_model(args.model, self.device, self.dtype, num_layers=args.num_layers)
        if args.lora_rank < 0:
            raise ValueError(f"--lora-rank={args.lora_rank} must be >= 0 (0: no adapter)")
        if args.lora_rank:  # as the trainer rolls out: the policy's LoRA adapter active in every mode
            make_trainable(self.bench.adapter.transformer, args.lora_rank, self.bench.adapter.default_lora_targets)
        self.bench.adapter.check_guidance(_params(args, 1))
        self.rows_per_image = self.bench.adapter.rows_per_sample(_params(args, 1))
        needed = args.num_samples * self.rows_per_image
        self.max_batch_rows = args.max_batch_rows or max(needed, 2)
        self.engines: dict[bool, object] = {}

    # --- engines and pipeline calls ------------------------------------------------------------
    def engine(self, compiled: bool):
        from flowrl.engine.engine import DiffusionEngine

        if compiled not in self.engines:
            compile = self.args.compile_backend if compiled else False
            self.engines[compiled] = DiffusionEngine(
                self.bench.adapter,
                max_batch_rows=self.max_batch_rows,
                decode_chunk_size=self.args.decode_chunk_size,
                compile=compile,
            )
        return self.engines[compiled]

    def compile_in_place(self) -> None:
        self.engine(True)  # compiles the shared modules, so the pipeline runs compiled too

    def engine_batched(self, compiled: bool, steps: int, n: int):
        return lambda: self.engine(compiled).generate_batched(PROMPT, n, _params(self.args, steps))

    def engine_concurrent(self, compiled: bool, steps: int, n: int):
        def run():
            engine = self.engine(compiled)
            params = _params(self.args, steps)
            futures = [engine.submit(f"{PROMPT} #{i}", params.replace(seed=self.args.seed + i)) for i in range(n)]
            return [f.result() for f in futures]

        return run

    def pipeline_call(self, steps: int, n: int, calls: int = 1):
        kwargs = pipeline_prompt_kwargs(self.bench, [PROMPT] * n, self.args.guidance_scale, self.args.true_cfg_scale)
        height, width, num_frames = _size(self.args)
        if self.bench.adapter.frame_factor is not None:  # a video pipeline (WanPipeline)
            kwargs.update(num_frames=num_frames)

        def run():
            for i in range(calls):
                generator = torch.Generator(device=self.device).manual_seed(self.args.seed + i)
                self.bench.pipeline(
                    **kwargs,
                    num_inference_steps=steps,
                    height=height,
                    width=width,
                    output_type="pt",
                    generator=generator,
                )

        return run

    # --- one mode ---------------------------------------------------------------------------------
    def run_mode(self, mode: str) -> dict:
        args = self.args
        compiled = mode.endswith("-compiled")
        base = mode.removesuffix("-compiled")
        if compiled:
            self.compile_in_place()
        n = args.num_samples
        if base == "pipeline-serial":
            images = args.serial_samples or n
            warm, timed = self.pipeline_call(args.warmup_steps, 1), self.pipeline_call(args.steps, 1, images)
        elif base == "pipeline-batched":
            images = n
            warm, timed = self.pipeline_call(args.warmup_steps, n), self.pipeline_call(args.steps, n)
        elif base == "engine-batched":
            images = n
            warm, timed = (
                self.engine_batched(compiled, args.warmup_steps, n),
                self.engine_batched(compiled, args.steps, n),
            )
        else:
            images = n
            warm, timed = (
                self.engine_concurrent(compiled, args.warmup_steps, n),
                self.engine_concurrent(compiled, args.steps, n),
            )
        t0 = time.perf_counter()
        warm()
        if compiled and base.startswith("engine"):  # a lone request (batch 1) too, should it recompile
            self.engine_batched(True, args.warmup_steps, 1)()
        warmup_s = time.perf_counter() - t0
        engine = self.engine(compiled) if base.startswith("engine") else None
        if engine is not None:
            engine.reset_stats()
        reset_peak_memory(self.device)
        seconds = time_runs(timed, self.device, args.repeats)
        result = {
            "images_per_run": images,
            "seconds": seconds,
            "seconds_median": median(seconds),
            "images_per_second": images / median(seconds),
            "warmup_seconds": warmup_s,
            "peak_memory_gb": peak_memory_gb(self.device),
        }
        if engine is not None:
            stats = engine.stats()
            result.update(
                forwards_per_run=stats["num_forwards"] / args.repeats,
                mean_rows_per_forward=stats["mean_rows_per_forward"],
                rows_per_forward_hist=stats["rows_per_forward_hist"],
                decode_calls_per_run=stats["num_decode_calls"] / args.repeats,
            )
        else:
            batch = 1 if base == "pipeline-serial" else n
            # SD3's and Z-Image's pipelines concatenate cond and uncond rows; Qwen-Image's and FLUX's run
            # two forwards.
            rows = batch * (self.rows_per_image if self.bench.family in ("sd3", "z_image") else 1)
            result.update(mean_rows_per_forward=float(rows))
        return result

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


def _ratios(modes: dict) -> dict:
    def ips(name):
        m = modes.get(name)
        return m["images_per_second"] if m and "images_per_second" in m else None

    pairs = {
        "engine-batched / pipeline-batched": ("engine-batched", "pipeline-batched"),
        "engine-concurrent / engine-batched": ("engine-concurrent", "engine-batched"),
        "pipeline-batched / pipeline-serial": ("pipeline-batched", "pipeline-serial"),
        "engine-concurrent / pipeline-serial": ("engine-concurrent", "pipeline-serial"),
        "engine-batched-compiled / engine-batched": ("engine-batched-compiled", "engine-batched"),
        "engine-concurrent-compiled / engine-batched-compiled": (
            "engine-concurrent-compiled",
            "engine-batched-compiled",
        ),
        "engine-batched-compiled / pipeline-batched": ("engine-batched-compiled", "pipeline-batched"),
        "pipeline-batched-compiled / pipeline-batched": ("pipeline-batched-compiled", "pipeline-batched"),
    }
    return {label: ips(a) / ips(b) for label, (a, b) in pairs.items() if ips(a) and ips(b)}


def run_rollout(args) -> int:
    quiet_libraries()
    modes = resolve_modes(args.modes, args.compile)
    t_build = time.perf_counter()
    bench = RolloutBench(args)
    build_s = time.perf_counter() - t_build
    device, a = bench.device, args
    adapter = bench.bench.adapter
    experts = [m for m in (adapter.transformer, getattr(adapter, "transformer_2", None)) if m is not None]
    params_b = sum(p.numel() for m in experts for p in m.parameters()) / 1e9  # A14B: both experts'
    shown_params = f"{params_b:.2f} B transformer params" + (" in two experts" if len(experts) == 2 else "")
    report = JsonReport(
        args.json,
        {
            "benchmark": "rollout",
            "environment": environment(device),
            "settings": {
                "model": a.model,
                "family": bench.bench.family,
                "transformer_params_billion": params_b,
                "dtype": str(bench.dtype).replace("torch.", ""),
                "num_samples": a.num_samples,
                "steps": a.steps,
                "size": a.size,
                **dict(zip(("height", "width", "num_frames"), _size(a))),
                "guidance_scale": a.guidance_scale,
                "true_cfg_scale": a.true_cfg_scale,
                "noise_level": a.noise_level,
                "repeats": a.repeats,
                "warmup_steps": a.warmup_steps,
                "serial_samples": a.serial_samples or a.num_samples,
                "max_batch_rows": bench.max_batch_rows,
                "decode_chunk_size": a.decode_chunk_size,
                "compile_backend": a.compile_backend,
                "num_layers": a.num_layers,
                "lora_rank": a.lora_rank,
                "modes": modes,
            },
            "build_seconds": build_s,
            "modes": {},
        },
    )
    print(
        f"[bench] {a.model} ({shown_params}, {bench.dtype}) on {report.data['environment'].get('gpu') or device}; built in {build_s:.1f}s",
        flush=True,
    )
    # 1. Peak and FLOPs, once (before any compilation).
    peak = flop_count.measure_matmul_peak(device, bench.dtype, sustain_seconds=a.peak_seconds)
    try:
        height, width, num_frames = _size(a)
        row_flops = flop_count.transformer_flops_per_row(bench.bench.adapter, height, width, num_frames=num_frames)
        decode_flops = flop_count.decode_flops_per_image(bench.bench.adapter, height, width, num_frames)
        image_flops = a.steps * bench.rows_per_image * row_flops + decode_flops
    except Exception:  # noqa: BLE001 - timings without MFU beat no timings
        traceback.print_exc()
        row_flops = decode_flops = image_flops = None
    report.data.update(
        peak=peak,
        flops={
            "transformer_per_row": row_flops,
            "decode_per_image": decode_flops,
            "per_image": image_flops,
            "limit_images_per_second_sustained": peak["sustained_flops"] / image_flops if image_flops else None,
            "limit_images_per_second_burst": peak["burst_flops"] / image_flops if image_flops else None,
        },
    )
    report.save()
    if image_flops:
        print(
            f"[bench] matmul peak {peak['burst_flops'] / 1e12:.1f} TFLOP/s burst, {peak['sustained_flops'] / 1e12:.1f} sustained; "
            f"{row_flops / 1e12:.3f} TFLOP per row, {decode_flops / 1e12:.3f} per decode; "
            f"limit {report.data['flops']['limit_images_per_second_sustained']:.3f} img/s",
            flush=True,
        )
    # 2. The modes, eager first.
    for mode in modes:
        try:
            result = bench.run_mode(mode)
            result["mfu"] = result["images_per_second"] * image_flops / peak["sustained_flops"] if image_flops else None
        except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        report.data["modes"][mode] = result
        report.data["ratios"] = _ratios(report.data["modes"])
        report.save()
        shown = result.get("error") or f"{result['images_per_second']:.3f} img/s, MFU {_percent(result['mfu'])}"
        print(f"[bench] {mode}: {shown}", flush=True)
    bench.shutdown()
    _print_summary(report.data)
    return 0 if all("error" not in m for m in report.data["modes"].values()) else 1


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _print_summary(data: dict) -> None:
    rows = []
    for mode, m in data["modes"].items():
        if "error" in m:
            rows.append([mode, "ERROR", None, None, None, None, m["error"][:60]])
            continue
        hist = m.get("rows_per_forward_hist")
        rows.append(
            [
                mode,
                m["images_per_second"],
                m["seconds_median"],
                _percent(m["mfu"]),
                m["peak_memory_gb"],
                m.get("mean_rows_per_forward"),
                str(hist) if hist else "",
            ]
        )
    flops = data["flops"]
    print()
    print(
        f"== rollout: {data['settings']['model']}, {data['settings']['num_samples']} samples, {data['settings']['steps']} steps, "
        f"{shape_label(data['settings'])}, guidance {data['settings']['guidance_scale']}, {data['settings']['dtype']}, "
        f"{_lora_label(data['settings'])}{data['environment'].get('gpu') or data['environment']['device']}"
    )
    if flops["limit_images_per_second_sustained"]:
        print(
            f"   limit {flops['limit_images_per_second_sustained']:.3f} img/s at the sustained matmul peak "
            f"({data['peak']['sustained_flops'] / 1e12:.1f} TFLOP/s; burst {data['peak']['burst_flops'] / 1e12:.1f})"
        )
    print(format_table(["mode", "img/s", "s/run", "MFU", "peak GB", "rows/fwd", "rows/forward histogram"], rows))
    for label, value in data.get("ratios", {}).items():
        print(f"   {label}: {value:.3f}")


def _lora_label(settings: dict) -> str:
    """'LoRA rank R, ' for a run with an adapter (settings['lora_rank'] > 0), else ''."""
    return f"LoRA rank {settings['lora_rank']}, " if settings.get("lora_rank") else ""
