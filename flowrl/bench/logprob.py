"""`flowrl bench logprob`: the rollout-vs-trainer log-prob gap, and the speed of a training step.

1. The transformer gets what training gives it (a LoRA adapter on the attention projections,
   B = 0 at init so the policy is unchanged, or full fine-tuning with --lora-rank 0), and the
   engine generates N samples of one prompt with generate_batched (log-probs recorded) in the model
   dtype, under the trainer's --autocast as the colocated trainer sets it; with --compile, after
   regional torch.compile (as `engine.compile: true` in training).
2. Every stored window transition is re-scored the way the trainer does it
   (`flowrl.trainer.policy.score_transitions`: adapter.velocity on the stored latent, then
   sampler.sde_step(next_latents=...)), in micro-batches of each size of --micro-batches, once
   without and once with grad, and compared with the rollout's log-prob: mean and max |diff| per
   window step and overall, of the pass whose values the trainer uses at --old-log-prob
   (flowrl.trainer.update.Scoring: compiled, the no-grad pass when the rollout's log-probs are the
   denominator, the grad pass when the trainer recomputes it) and of each pass. A micro-batch that
   does not fit in memory is reported as such.
3. One training micro-batch (forward + backward of a PPO-style loss, then the optimizer step for
   LoRA) is timed at each size of --train-micro-batches (median of --train-repeats after a
   warm-up; the time per sample and the GPU's busy share move with it), with the transformer's gradient
   checkpointing when --gradient-checkpointing asks (as the recipes train) and, where the trainer
   runs one (compiled, --old-log-prob rollout), its extra no-grad pass; its FLOPs are counted
   once and MFU is reported against the matmul peak measured in the same run. --profile then
   profiles one more step: where its device time goes, and how much of the step's timed wall
   time the GPU was busy at all (a low share means the host, not the GPU, sets the pace).
"""

from __future__ import annotations

import time
import traceback

import torch

from flowrl.bench import flops as flop_count
from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.bench.report import (
    JsonReport,
    environment,
    format_table,
    median,
    peak_memory_gb,
    profile_lines,
    profile_summary,
    quiet_libraries,
    reset_peak_memory,
    resolve_device_dtype,
    time_runs,
)
from flowrl.bench.summary import ms_list
from flowrl.sampling_params import SamplingParams
from flowrl.trainer.policy import MIXED_PRECISION_DTYPES, takes_values_from_no_grad
from flowrl.trainer.update import Scoring

PROMPT = "a photo of a red bicycle leaning on a white wall"


def parse_micro_batches(text: str, option: str = "--micro-batches") -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{option}={text!r} must be a comma list of integers >= 1, e.g. 1,8,32")
    return sizes


def _rollout_tensors(outputs) -> dict[str, torch.Tensor]:
    from flowrl.rollout.agent_loop import OUTPUT_TO_BATCH
    from flowrl.rollout.batch import stack_rows

    return stack_rows([{dst: getattr(o, src) for src, dst in OUTPUT_TO_BATCH.items()} for o in outputs])


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _scoring(adapter, old_log_prob_mode: str) -> Scoring:
    """How the trainer scores this model at algorithm.old_log_prob=`old_log_prob_mode`."""
    return Scoring.choose(takes_values_from_no_grad(adapter), old_log_prob_mode)


def measure_gap(adapter, tensors, spec, micro_batch: int, autocast_dtype, old_log_prob_mode: str = "rollout") -> dict:
    """|trainer log-prob - rollout log-prob| per window step, from a no-grad and a grad pass over
    each micro-batch. The top-level figures are those of the pass whose values the trainer uses at
    `old_log_prob_mode` (flowrl.trainer.update.Scoring); both passes are reported."""
    from flowrl.trainer.policy import score_transitions

    num_samples, window = tensors["all_log_probs"].shape
    diffs = {"grad": torch.zeros(num_samples, window, dtype=torch.float64)}
    diffs["no_grad"] = torch.zeros_like(diffs["grad"])
    t0 = time.perf_counter()
    for step in range(window):
        for start in range(0, num_samples, micro_batch):
            rows = torch.arange(start, min(start + micro_batch, num_samples))
            mb = {name: t[rows] for name, t in tensors.items()}
            step_index = torch.full((rows.shape[0],), step, dtype=torch.long)
            rollout = mb["all_log_probs"][:, step].double()
            for mode, grad in (("no_grad", False), ("grad", True)):
                with torch.set_grad_enabled(grad):
                    log_prob = score_transitions(adapter, mb, step_index, spec, autocast_dtype).log_prob.detach()
                diffs[mode][rows, step] = (log_prob.double().cpu() - rollout).abs()
    values_from = "no_grad" if _scoring(adapter, old_log_prob_mode).values == "value_pass" else "grad"
    trainer = diffs[values_from]
    return {
        "micro_batch": micro_batch,
        "trainer_values_from": f"{values_from} pass",
        "mean_abs_diff": float(trainer.mean()),
        "max_abs_diff": float(trainer.max()),
        "mean_abs_diff_per_step": trainer.mean(dim=0).tolist(),
        "max_abs_diff_per_step": trainer.max(dim=0).values.tolist(),
        **{
            f"{mode}_pass": {"mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max())}
            for mode, d in diffs.items()
        },
        "rollout_log_prob_mean": float(tensors["all_log_probs"].double().mean()),
        "seconds": time.perf_counter() - t0,
    }


def time_training_step(
    adapter,
    params,
    tensors,
    spec,
    micro_batch: int,
    autocast_dtype,
    repeats: int,
    device,
    profile: bool = False,
    old_log_prob_mode: str = "rollout",
    on_timed=None,
    kl_beta: float = 0.0,
    cuda_graphs: bool = False,
) -> dict:
    """Forward + backward of a clipped-ratio style loss on one micro-batch (+ AdamW step for LoRA),
    scored as the trainer scores a later optimizer step at algorithm.old_log_prob=
    `old_log_prob_mode` (flowrl.trainer.update.Scoring: with or without its value pass, against a
    denominator recomputed in the graph of its values or the rollout's); with algorithm.kl_beta=
    `kl_beta` > 0, plus the LoRA-disabled reference's no-grad forward and the KL loss, as
    flowrl.trainer.update adds them; with `profile`, also one
    profiled step (see the module docstring). cuda_graphs: the compiled blocks' grad calls replay as
    CUDA graphs (flowrl.accel.set_training_cuda_graphs). `on_timed(result)` gets the
    timings as soon as they are measured, before the FLOP count, so a count that fails (it runs the
    step eagerly under a dispatch mode) cannot take the timings with it."""
    from flowrl.sampler import kl_to_reference
    from flowrl.trainer.lora import adapter_disabled
    from flowrl.trainer.policy import score_transitions

    rows = torch.arange(min(micro_batch, tensors["all_log_probs"].shape[0]))
    # AdamW for LoRA-sized training; full fine-tuning of a big model would need its optimizer
    # states (several times the weights) just to time a step.
    use_optimizer = sum(p.numel() for p in params) < 1_000_000_000
    scoring = _scoring(adapter, old_log_prob_mode)
    optimizer = torch.optim.AdamW(params, lr=1e-6) if use_optimizer else None
    from flowrl.accel import is_compiled, set_training_cuda_graphs

    if is_compiled(adapter):
        set_training_cuda_graphs(adapter, cuda_graphs)

    def make_forward_backward(rows: torch.Tensor):
        mb = {name: t[rows] for name, t in tensors.items()}
        step_index = torch.zeros(rows.shape[0], dtype=torch.long)
        advantages = torch.linspace(-1.0, 1.0, rows.shape[0], device=device)
        old_log_prob = mb["all_log_probs"][:, 0].to(device)
        if old_log_prob_mode == "recompute":
            with torch.set_grad_enabled(scoring.recompute_with_grad):
                old_log_prob = score_transitions(adapter, mb, step_index, spec, autocast_dtype).log_prob.detach()

        def forward_backward():
            result = score_transitions(
                adapter, mb, step_index, spec, autocast_dtype, values_from_no_grad=scoring.values == "value_pass"
            )  # as the trainer scores
            ratio = torch.exp(result.log_prob - old_log_prob)
            loss = -(advantages * ratio).mean()
            if kl_beta > 0:
                with torch.no_grad(), adapter_disabled(adapter.transformer):
                    reference = score_transitions(adapter, mb, step_index, spec, autocast_dtype).mean
                loss = loss + kl_beta * kl_to_reference(result, reference).mean()
            loss.backward()

        return forward_backward

    forward_backward = make_forward_backward(rows)

    def train_step():
        forward_backward()
        if optimizer is not None:
            optimizer.step()
        for p in params:
            p.grad = None

    with torch.enable_grad():
        train_step()  # warm-up
        reset_peak_memory(device)
        seconds = time_runs(train_step, device, repeats)
        result = {
            "micro_batch": int(rows.shape[0]),
            "seconds": seconds,
            "seconds_median": median(seconds),
            "optimizer_step_included": optimizer is not None,
            "peak_memory_gb": peak_memory_gb(device),
        }
        if on_timed is not None:
            on_timed(dict(result))
        # The FLOPs are counted eagerly (flop_count), which can need more memory than the compiled
        # step; every row has the same shapes, so one sample's count times the rows is exact.
        fwd_bwd_flops, counted_rows = None, None
        for attempt in (rows, rows[:1]) if rows.shape[0] > 1 else (rows,):
            try:
                fn = forward_backward if attempt is rows else make_forward_backward(attempt)
                fwd_bwd_flops = flop_count.count_flops(fn) * rows.shape[0] // attempt.shape[0]
                counted_rows = int(attempt.shape[0])
                break
            except Exception as exc:  # noqa: BLE001 - keep the timing without MFU
                for p in params:
                    p.grad = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if not _is_oom(exc):
                    traceback.print_exc()
                    break
        for p in params:
            p.grad = None
        result["flops_forward_backward"] = fwd_bwd_flops
        result["flops_counted_at_micro_batch"] = counted_rows
        if profile:
            result["profile"] = profile_summary(train_step, device)
            if device.type == "cuda":
                # Kernel time over the unprofiled step's wall time: the profiler's own host cost
                # would otherwise count as idle GPU.
                result["profile"]["gpu_busy"] = result["profile"]["total_ms"] / 1000.0 / result["seconds_median"]
    return result


def run_logprob(args) -> int:
    quiet_libraries()
    sizes = parse_micro_batches(args.micro_batches)
    train_sizes = (
        parse_micro_batches(args.train_micro_batches, "--train-micro-batches")
        if args.train_micro_batches is not None
        else None
    )
    if args.kl_beta < 0 or (args.kl_beta > 0 and args.lora_rank == 0):
        raise ValueError(
            f"--kl-beta={args.kl_beta}: the KL term needs a weight >= 0 and a LoRA (its reference is the "
            "model with the LoRA switched off); pass --lora-rank > 0, or --kl-beta 0"
        )
    if train_sizes and max(train_sizes) > args.num_samples:
        raise ValueError(
            f"--train-micro-batches={args.train_micro_batches!r}: a micro-batch of {max(train_sizes)} "
            f"needs at least that many samples; raise -n (now {args.num_samples})"
        )
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    graph_modes = _cuda_graph_modes(args.cuda_graphs, args.compile and args.compile_backend == "inductor", device)
    bench = build_bench_model(args.model, device, dtype, num_layers=args.num_layers)
    adapter = bench.adapter
    params = make_trainable(adapter.transformer, args.lora_rank, adapter.default_lora_targets)
    if args.gradient_checkpointing:  # before compiling, as the trainer does
        adapter.transformer.enable_gradient_checkpointing()
    autocast_dtype = MIXED_PRECISION_DTYPES[args.autocast]
    report = JsonReport(
        args.json,
        {
            "benchmark": "logprob",
            "environment": environment(device),
            "settings": {
                "model": args.model,
                "dtype": str(dtype).replace("torch.", ""),
                "num_samples": args.num_samples,
                "steps": args.steps,
                "size": args.size,
                "guidance_scale": args.guidance_scale,
                "true_cfg_scale": args.true_cfg_scale,
                "noise_level": args.noise_level,
                "lora_rank": args.lora_rank,
                "autocast": args.autocast,
                "sde_window_size": args.sde_window_size,
                "micro_batches": sizes,
                "compile": args.compile_backend if args.compile else False,
                "compile_rounding": args.compile_rounding,
                "trainable_params": sum(p.numel() for p in params),
                "gradient_checkpointing": args.gradient_checkpointing,
                "old_log_prob": args.old_log_prob,
                "kl_beta": args.kl_beta,
                "cuda_graphs": args.cuda_graphs,
            },
            "gaps": [],
        },
    )
    peak = flop_count.measure_matmul_peak(device, dtype, sustain_seconds=args.peak_seconds)
    report.data["peak"] = peak
    # 1. Rollout with the engine (batched, model dtype).
    from flowrl.engine.engine import DiffusionEngine
    from flowrl.engine.output import TransitionSpec

    params_sampling = SamplingParams(
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale,
        noise_level=args.noise_level,
        seed=args.seed,
        sde_window_size=args.sde_window_size,
    )
    rows_per_sample = adapter.rows_per_sample(params_sampling)
    # With --compile the blocks are compiled after LoRA injection, as the trainer does; rollout
    # and trainer then both run compiled (the trainer's grad-mode graph is a second graph).
    engine = DiffusionEngine(
        adapter,
        max_batch_rows=args.max_batch_rows or max(2, args.num_samples * rows_per_sample),
        compile=args.compile_backend if args.compile else False,
        autocast_dtype=autocast_dtype,
        compile_rounding=args.compile_rounding,
    )
    t0 = time.perf_counter()
    outputs = engine.generate_batched(PROMPT, args.num_samples, params_sampling)
    report.data["rollout_seconds"] = time.perf_counter() - t0
    report.data["rollout_rows_per_forward"] = engine.stats()["mean_rows_per_forward"]
    engine.shutdown()
    tensors = _rollout_tensors(outputs)
    spec = TransitionSpec.of(params_sampling)
    print(
        f"[bench] rollout of {args.num_samples} samples x {tensors['all_log_probs'].shape[1]} window steps "
        f"in {report.data['rollout_seconds']:.1f}s",
        flush=True,
    )
    # 2. Gap per micro-batch size.
    for size in sizes:
        try:
            gap = measure_gap(adapter, tensors, spec, size, autocast_dtype, args.old_log_prob)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other sizes
            if not _is_oom(exc):
                traceback.print_exc()
            gap = {"micro_batch": size, "error": "out of memory" if _is_oom(exc) else f"{type(exc).__name__}: {exc}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.data["gaps"].append(gap)
        report.save()
        shown = (
            f"mean {gap['mean_abs_diff']:.3g}, max {gap['max_abs_diff']:.3g}" if "error" not in gap else gap["error"]
        )
        print(f"[bench] micro-batch {size}: |trainer - rollout| log-prob {shown}", flush=True)
    # 3. Training step speed, per micro-batch size (what a sample costs, and how busy the host keeps
    #    the GPU, both move with it).
    fitting = [g["micro_batch"] for g in report.data["gaps"] if "error" not in g]
    report.data["training_steps"] = []
    for train_mb, graphed in [(mb, g) for mb in train_sizes or [max(fitting) if fitting else 1] for g in graph_modes]:
        train = {"micro_batch": train_mb, "cuda_graphs": graphed}
        report.data["training_steps"].append(train)

        def keep_timings(timed: dict, train: dict = train) -> None:
            train.update(timed)
            report.save()

        try:
            timed = time_training_step(
                adapter,
                params,
                tensors,
                spec,
                train_mb,
                autocast_dtype,
                args.train_repeats,
                device,
                profile=args.profile,
                old_log_prob_mode=args.old_log_prob,
                on_timed=keep_timings,
                kl_beta=args.kl_beta,
                cuda_graphs=graphed,
            )
            train.update(timed)
            # MFU of the forward + backward FLOPs over the whole step's time (AdamW on LoRA is small).
            flops = train["flops_forward_backward"]
            train["mfu"] = flops / train["seconds_median"] / peak["sustained_flops"] if flops else None
        except Exception as exc:  # noqa: BLE001 - report and go on with the other sizes
            if not _is_oom(exc):
                traceback.print_exc()
            train["error"] = "out of memory" if _is_oom(exc) else f"{type(exc).__name__}: {exc}"
            report.save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.save()
    _print_summary(report.data)
    ok = all("error" not in r for r in report.data["gaps"] + report.data["training_steps"])
    return 0 if ok else 1


def _cuda_graph_modes(setting: str, compiled_with_inductor: bool, device: torch.device) -> list[bool]:
    """--cuda-graphs as the training steps to time: without CUDA graphs, with them, or both (in
    that order)."""
    if setting != "off" and not (compiled_with_inductor and device.type == "cuda"):
        raise ValueError(
            f"--cuda-graphs={setting} replays the compiled training graphs on a GPU; pass --compile (inductor) "
            "on a CUDA device, or --cuda-graphs off"
        )
    return {"on": [True], "off": [False], "both": [False, True]}[setting]


def _flops_text(step: dict, sustained_flops: float) -> str:
    """The step's forward + backward FLOPs and its MFU against the sustained peak, saying when the
    count was scaled from one sample or could not be made."""
    flops = step.get("flops_forward_backward")
    if not flops:
        return "FLOPs not counted (no MFU)"
    scaled = step.get("flops_counted_at_micro_batch")
    note = f" (counted at micro-batch {scaled}, scaled)" if scaled and scaled != step["micro_batch"] else ""
    return (
        f"{flops / 1e12:.2f} TFLOP fwd+bwd{note}, MFU {(step.get('mfu') or 0):.1%} of "
        f"{sustained_flops / 1e12:.1f} TFLOP/s"
    )


def _print_summary(data: dict) -> None:
    s = data["settings"]
    print()
    print(
        f"== logprob: {s['model']}, {s['num_samples']} samples, {s['steps']} steps, {s['size']}px, guidance "
        f"{s['guidance_scale']}, {s['dtype']}, LoRA rank {s['lora_rank']}, autocast {s['autocast']}, "
        f"{'compiled' if s.get('compile') else 'eager'}, "
        f"{data['environment'].get('gpu') or data['environment']['device']}"
    )
    rows = []
    for g in data["gaps"]:
        if "error" in g:
            rows.append([g["micro_batch"], None, None, None, None, g["error"]])
        else:
            per_step = " ".join(f"{v:.1e}" for v in g["max_abs_diff_per_step"])
            passes = [
                f"{g[p]['mean_abs_diff']:.2e} / {g[p]['max_abs_diff']:.2e}" for p in ("no_grad_pass", "grad_pass")
            ]
            rows.append([g["micro_batch"], g["mean_abs_diff"], g["max_abs_diff"], *passes, per_step])
    values_from = next((g["trainer_values_from"] for g in data["gaps"] if "error" not in g), "?")
    print(f"   |trainer - rollout| log-prob; the trainer's values come from the {values_from}")
    print(
        format_table(
            [
                "micro-batch",
                "mean |diff|",
                "max |diff|",
                "no-grad pass mean / max",
                "grad pass mean / max",
                "max |diff| per window step",
            ],
            rows,
        )
    )
    for t in data.get("training_steps", []):
        if "error" in t and "seconds_median" not in t:
            print(f"   training step (micro-batch {t['micro_batch']}): {t['error']}")
            continue
        if "error" in t:
            print(f"   training step (micro-batch {t['micro_batch']}): timed, then failed: {t['error']}")
        print(
            f"   training step, micro-batch {t['micro_batch']}{', CUDA graphs' if t.get('cuda_graphs') else ''}: "
            f"{t['seconds_median'] * 1000:.1f} ms "
            f"({t['seconds_median'] * 1000 / t['micro_batch']:.1f} ms per sample; median of {ms_list(t['seconds'])} ms; "
            f"forward+backward{' + AdamW' if t['optimizer_step_included'] else ''}), "
            f"{_flops_text(t, data['peak']['sustained_flops'])}, peak memory {t['peak_memory_gb'] or 0:.1f} GB"
            f"{' (gradient checkpointing: the FLOPs include its recomputed forward)' if s.get('gradient_checkpointing') else ''}"
            f"{'; old_log_prob recompute' if s.get('old_log_prob') == 'recompute' else ''}"
        )
        if t.get("profile"):
            print("\n".join(profile_lines(t["profile"], f"one training step, micro-batch {t['micro_batch']}")))
