"""`flowrl bench train --config RECIPE [KEY=VALUE ...] [--steps K]`: a recipe's whole training step,
measured phase by phase, against its FLOP limits and against a peer's loop in the same process.

1. The recipe with the overrides, loaded as `flowrl train` loads it (usually with
   `model.path=random:NAME`, a weight-free reward and the embedded prompts); the run folder is a
   temporary one, without tensorboard or progress bar. Every cheap check runs before the model loads.
2. The sustained matmul peak is measured; the model is loaded into the engine as the trainer loads it.
3. With the trainer's LoRA in place on the still-eager model: the FLOPs of one representative call
   of each kind (flowrl.run.step_flops), then the peer's loop (flowrl.bench.peer): a warm-up
   step on one pipeline call, then --peer-steps timed steps. The LoRA is removed afterwards.
4. The real Trainer on the same engine: one warm-up step (it compiles), then K timed steps,
   each followed by validation whenever trainer.val_every says so, as `fit` does.
5. One more rollout of a step's prompts with nothing around it (no reward, no trainer step), to
   set the step's rollout phase against.
6. Per phase, the median over the timed steps of the trainer's own timings (`timing/*_s`: rollout,
   reward time not hidden behind the rollout, old log-prob, update, weight-version bump,
   validation), its FLOPs, its limit (those FLOPs at the measured peak) and its MFU; the whole
   step's images per second, its time over the sum of the phases' limits, the peak GPU memory,
   the peer's step over flowrl's, and how long trainer.total_steps of the recipe would take.

The JSON (--json) is rewritten after every measurement.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import traceback

import torch

from flowrl.bench.report import (
    JsonReport,
    environment,
    median,
    peak_memory,
    quiet_libraries,
    reset_peak_memory,
    sample_unit,
    shape_label,
    synchronize,
)
from flowrl.config.algorithm_rules import FORWARD_PROCESS
from flowrl.run import flops as flop_count
from flowrl.run.step_flops import count_unit_flops, trainable, trained_steps_per_sample, window_size
from flowrl.trainer.flow_grpo import phase_flops
from flowrl.trainer.forward_process import trained_pairs_per_sample, trained_timesteps

# phase -> the trainer's metric holding its seconds
PHASE_METRICS = {
    "rollout": "timing/rollout_s",
    "reward_wait": "timing/reward_wait_s",
    "old_log_prob": "timing/old_log_prob_s",
    "update": "timing/update_s",
    "weight_sync": "timing/weight_sync_s",
    "validation": "timing/val_s",
}
BENCH_OVERRIDES = ("logging.tensorboard=false", "logging.wandb=false", "logging.progress_bar=false")


def load_bench_config(config: str, overrides: list[str], output_dir: str):
    from flowrl.run.config import load_train_config

    return load_train_config(config, [*overrides, *BENCH_OVERRIDES, f"trainer.output_dir={output_dir}"])


def summarize(steps: list[dict], peak_flops: float) -> dict:
    """Medians over the timed steps: per phase (over the steps it ran in) its seconds, FLOPs, limit
    (FLOPs at the peak) and MFU; the training step (validation apart: it is a phase of its own,
    run every val_every steps), its img/s, its time over the sum of its phases' limits and its MFU."""
    out = {"phases": {}}
    for phase in PHASE_METRICS:
        ran = [s for s in steps if phase in s["seconds"]]
        if not ran:
            continue
        seconds = median([s["seconds"][phase] for s in ran])
        flops = median([s["flops"].get(phase, 0.0) for s in ran])
        out["phases"][phase] = {
            "seconds": seconds,
            "flops": flops,
            "limit_seconds": flops / peak_flops,
            "mfu": flops / seconds / peak_flops if flops and seconds > 0 else None,
        }
    step = median([s["step_seconds"] for s in steps])
    training = {name: p for name, p in out["phases"].items() if name != "validation"}
    limits = sum(p["limit_seconds"] for p in training.values())
    out.update(
        step_seconds=step,
        other_seconds=step - sum(p["seconds"] for p in training.values()),
        images_per_second=median([s["samples"] for s in steps]) / step,
        limit_seconds=limits,
        step_over_limits=step / limits if limits else None,
        mfu=sum(p["flops"] for p in training.values()) / step / peak_flops,
    )
    return out


def _record_steps(report, steps: list[dict], peak_flops: float) -> None:
    """flowrl's timed steps so far, summarized (`summarize`), with the peer's step over flowrl's where
    the peer ran, saved: a run stopped by its time limit later still reports them."""
    report.data["flowrl"].update(summarize(steps, peak_flops))
    peer = report.data.get("peer", {})
    if "step_seconds" in peer:
        report.data["peer_over_flowrl"] = peer["step_seconds"] / report.data["flowrl"]["step_seconds"]
    report.save()


def projection(cfg, recipe_cfg, flowrl: dict, gpus: int) -> dict:
    """trainer.total_steps at the measured step time (validation every val_every steps when it was
    timed), and at the recipe file's own step size, scaled linearly in samples."""
    tcfg = cfg.trainer
    val = flowrl["phases"].get("validation")
    per_step = flowrl["step_seconds"] + (val["seconds"] / tcfg.val_every if val and tcfg.val_every else 0.0)
    samples = tcfg.prompts_per_step * cfg.rollout.n
    recipe_samples = recipe_cfg.trainer.prompts_per_step * recipe_cfg.rollout.n
    hours = tcfg.total_steps * per_step / 3600.0
    return {
        "total_steps": tcfg.total_steps,
        "samples_per_step": samples,
        "hours": hours,
        "validation_included": bool(val and tcfg.val_every),
        "recipe_samples_per_step": recipe_samples,
        "hours_at_recipe_size": hours * recipe_samples / samples,
        "gpus": gpus,
        "hours_at_recipe_size_on_gpus": hours * recipe_samples / samples / gpus,
    }


# torch.cuda.memory_stats counters a step's record gives as deltas: allocations the caching allocator
# could not serve from its cache (cudaMalloc calls), blocks it gave back (cudaFree, which waits for
# the device), and the times a failed cudaMalloc made it free its whole cache and retry
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _allocator_counters() -> dict:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTERS}


def _flowrl_step(trainer, units, cfg) -> dict:
    before = _allocator_counters()
    metrics = trainer.train_step()
    after = _allocator_counters()
    val_every = cfg.trainer.val_every
    if val_every and trainer.step % val_every == 0:
        metrics.update(trainer.validate())
    seconds = {phase: metrics[key] for phase, key in PHASE_METRICS.items() if key in metrics}
    rows = int(metrics.get("adv/num_rows_trained", 0))
    validated = len(trainer.val_rows) if "validation" in seconds else 0
    return {
        "step": trainer.step,
        "samples": cfg.trainer.prompts_per_step * cfg.rollout.n,
        "rows_trained": rows,
        "seconds": seconds,
        "step_seconds": metrics["timing/step_s"],  # validation apart
        "flops": trainer.algorithm.phase_flops(units, rows, validated),  # the algorithm's own phases
        "rows_per_forward": metrics.get("rollout/mean_rows_per_forward"),
        # rollout.merge_lora: the adapter's merge into the rollout's weights (part of the rollout phase)
        "lora_merge_seconds": metrics.get("timing/lora_merge_s"),
        "logprob_gap_max": metrics.get("actor/logprob_gap_max"),
        "kl": metrics.get("actor/kl"),  # the KL term's mean (0 without one)
        # the share of the recompute's forwards scored while the rewards were computed
        "old_log_prob_early_share": metrics.get("actor/old_log_prob_early_share"),
        # What trainer.gradient_checkpointing ran with ("auto": decided at the first update).
        "gradient_checkpointing": (
            bool(metrics["memory/gradient_checkpointing"]) if "memory/gradient_checkpointing" in metrics else None
        ),
        "activations_per_sample_gb": metrics.get("memory/activations_per_sample_gb"),
        "allocator": {name: after[name] - before[name] for name in after},  # on a GPU: ALLOCATOR_COUNTERS
    }


def _rollout_alone(trainer, cfg, device) -> float:
    """Seconds of one more rollout of a step's prompts through the trainer's agent loop and engine
    (its compiled graphs, LoRA and mixed precision) with nothing around it: no reward scoring, no
    wait that polls for a stop, no step before or after. Against the step's rollout phase it shows
    what the trainer's surroundings cost the rollout. The trainer's data position and row count
    are left as they were."""
    from flowrl.data.prompts import PromptSampler
    from flowrl.rollout.batch import RolloutBatch

    rows = PromptSampler(trainer.prompts.rows, cfg.trainer.prompts_per_step, shuffle=False, seed=0).next_rows()
    trainer.samples.prepare_rows(rows, trainer.step)
    batch = RolloutBatch.from_rows(rows).repeat(cfg.rollout.n)
    rows_generated = trainer.agent_loop.rows_generated
    try:
        synchronize(device)
        t0 = time.perf_counter()
        with trainer.rollout_weights():
            trainer.agent_loop.generate_sequences(batch)
        synchronize(device)
        return time.perf_counter() - t0
    finally:
        trainer.agent_loop.rows_generated = rows_generated


def _peer_step(peer, prompts, units, cfg, samples_per_prompt=None) -> dict:
    rows = prompts.next_rows()
    result = peer.step(rows[:1] if samples_per_prompt else rows, samples_per_prompt)
    seconds = {phase: result[f"{phase}_s"] for phase in ("rollout", "reward_wait", "old_log_prob", "update")}
    return {
        "samples": result["samples"],
        "rows_trained": result["rows_trained"],
        "seconds": seconds,
        "step_seconds": result["step_s"],
        "flops": phase_flops(units, cfg, result["rows_trained"]),
    }


def _run_peer(adapter, cfg, prepared, units, args, report, device) -> None:
    from flowrl.bench.peer import PeerLoop
    from flowrl.data.prompts import PromptSampler

    with trainable(adapter.transformer, cfg.trainer) as params:
        peer = PeerLoop(adapter, cfg, prepared.reward, params)
        prompts = PromptSampler(prepared.train_rows, cfg.trainer.prompts_per_step, cfg.data.shuffle, cfg.trainer.seed)
        # The references checkpoint every block; "auto" is flowrl's choice, not theirs.
        peer_checkpoints = cfg.trainer.gradient_checkpointing is not False
        if peer_checkpoints:
            adapter.transformer.enable_gradient_checkpointing()
        try:
            _peer_step(peer, prompts, units, cfg, samples_per_prompt=peer.batch)  # warm-up
            reset_peak_memory(device)
            steps = []
            for _ in range(args.peer_steps):
                steps.append(_peer_step(peer, prompts, units, cfg))
                print(f"[bench] peer step: {steps[-1]['step_seconds']:.2f}s", flush=True)
        finally:
            peer.close()
            if peer_checkpoints:
                adapter.transformer.disable_gradient_checkpointing()
    report.data["peer"] = {
        "batch": peer.batch,
        "gradient_checkpointing": peer_checkpoints,
        "steps": steps,
        **peak_memory(device),
    }
    report.data["peer"].update(summarize(steps, report.data["peak"]["sustained_flops"]))
    report.save()


def run_train(args) -> int:
    from flowrl.run.checks import check_before_loading
    from flowrl.run.config import load_train_config

    quiet_libraries()
    output_dir = tempfile.mkdtemp(prefix="flowrl-bench-train-")
    try:
        cfg = load_bench_config(args.config, list(args.overrides), output_dir)
        recipe_cfg = load_train_config(args.config, [])
        prepared = check_before_loading(cfg)  # every cheap check before the model loads
        args.peer_steps = _peer_steps(args.peer_steps, cfg)
    except ValueError as error:
        shutil.rmtree(output_dir, ignore_errors=True)
        print(f"flowrl bench train: error: {error}", file=sys.stderr)
        return 2
    try:
        return _measure(args, cfg, recipe_cfg, prepared)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)


def _peer_steps(asked: int | None, cfg) -> int:
    """--peer-steps checked against the algorithm (the peer's loop is Flow-GRPO's); None: the default."""
    forward_process = cfg.algorithm.name in FORWARD_PROCESS
    if asked is None:
        return 0 if forward_process else 1
    if asked < 0:
        raise ValueError(f"--peer-steps={asked} must be >= 0 (0: no peer loop)")
    if asked and forward_process:
        raise ValueError(
            f"--peer-steps={asked}: the peer loop is Flow-GRPO's training loop; algorithm.name="
            f"{cfg.algorithm.name} has none here; pass --peer-steps 0"
        )
    return asked


def _trained_per_sample(cfg, adapter) -> int:
    """Timesteps each sample trains: the SDE window's trained share (FlowGRPO) or the forward
    process's int(fraction x the steps the trained module predicts) (flowrl.trainer.forward_process)."""
    if cfg.algorithm.name in FORWARD_PROCESS:
        fraction = cfg.algorithm.train_timestep_fraction
        return trained_pairs_per_sample(trained_timesteps(adapter, cfg.rollout.sampling), fraction)
    return trained_steps_per_sample(cfg)


def _settings(args, cfg, adapter) -> dict:
    s, tcfg = cfg.rollout.sampling, cfg.trainer
    return {
        "config": args.config,
        "overrides": list(args.overrides),
        "model": cfg.model.path,
        "random_weights": getattr(adapter, "random_weights", None),
        "dtype": cfg.model.dtype,
        "compile": cfg.engine.compile,
        "prompts_per_step": tcfg.prompts_per_step,
        "n": cfg.rollout.n,
        "samples_per_step": tcfg.prompts_per_step * cfg.rollout.n,
        "steps": s.num_inference_steps,
        "size": s.height,
        "height": s.height,
        "width": s.width,
        "num_frames": s.num_frames,
        "guidance_scale": s.guidance_scale,
        "true_cfg_scale": s.true_cfg_scale,
        "rows_per_sample": adapter.rows_per_sample(s),
        "window": window_size(s),
        "trained_steps_per_sample": _trained_per_sample(cfg, adapter),
        "micro_batch_size": tcfg.micro_batch_size,
        "updates_per_step": tcfg.updates_per_step,
        "lora_rank": tcfg.lora.rank if tcfg.lora.enabled else 0,
        "gradient_checkpointing": tcfg.gradient_checkpointing,
        "mixed_precision": tcfg.mixed_precision,
        "old_log_prob": cfg.algorithm.old_log_prob,
        "kl_beta": cfg.algorithm.kl_beta,
        "reward": cfg.reward.name or [c["name"] for c in cfg.reward.components],
        "timed_steps": args.steps,
        "peer_steps": args.peer_steps,
    }


def _measure(args, cfg, recipe_cfg, prepared) -> int:
    from flowrl.config import config_to_dict
    from flowrl.run.checks import build_engine
    from flowrl.trainer.trainer import Trainer

    device = torch.device(cfg.model.resolve_device())
    engine = build_engine(cfg)
    adapter = engine.adapter
    report = JsonReport(
        args.json, {"benchmark": "train", "environment": environment(device), "settings": _settings(args, cfg, adapter)}
    )
    report.data["config"] = config_to_dict(cfg)
    peak = flop_count.measure_matmul_peak(device, adapter.dtype, sustain_seconds=args.peak_seconds)
    report.data["peak"] = peak
    prompt = prepared.train_rows[0]["raw_prompt"]
    with trainable(adapter.transformer, cfg.trainer):
        units = count_unit_flops(adapter, cfg, prompt)
    report.data["flops"] = units.as_dict()
    report.save()
    if args.peer_steps:
        try:
            _run_peer(adapter, cfg, prepared, units, args, report, device)
        except Exception as exc:  # noqa: BLE001 - flowrl's own step is still worth measuring
            traceback.print_exc()
            report.data["peer"] = {"error": f"{type(exc).__name__}: {exc}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the peer's optimizer states and cached blocks, back before flowrl's run
    trainer = Trainer(cfg, engine=engine, reward=prepared.reward)
    try:
        warmup = _flowrl_step(trainer, units, cfg)  # compiles: what a run's first step costs
        shown = ", ".join(f"{p} {s:.2f}" for p, s in warmup["seconds"].items())
        print(f"[bench] flowrl warm-up step: {warmup['step_seconds']:.2f}s ({shown})", flush=True)
        reset_peak_memory(device)
        steps = []
        report.data["flowrl"] = {"warmup": warmup, "steps": steps}
        for _ in range(args.steps):
            steps.append(_flowrl_step(trainer, units, cfg))
            _record_steps(report, steps, peak["sustained_flops"])  # a run cut short keeps the steps it timed
            shown = ", ".join(f"{p} {s:.2f}" for p, s in steps[-1]["seconds"].items())
            print(f"[bench] flowrl step {steps[-1]['step']}: {steps[-1]['step_seconds']:.2f}s ({shown})", flush=True)
        report.data["flowrl"].update(peak_memory(device))
        report.data["flowrl"]["rollout_alone_seconds"] = _rollout_alone(trainer, cfg, device)
        report.save()
    finally:
        trainer.close()
    untrained = sum(not s["rows_trained"] for s in steps + report.data.get("peer", {}).get("steps", []))
    _record_steps(report, steps, peak["sustained_flops"])
    peer = report.data.get("peer", {})
    report.data["projection"] = projection(cfg, recipe_cfg, report.data["flowrl"], args.project_gpus)
    if untrained:
        report.data["error"] = (
            f"{untrained} timed steps trained no sample (every group's rewards were equal, and "
            "algorithm.zero_std_policy=drop dropped them): their update was not measured; use a reward that "
            "separates the images"
        )
    report.save()
    print("\n".join(train_lines(report.data)))
    return 1 if untrained or "error" in peer else 0


_PHASE_LABELS = {
    "rollout": "rollout (VAE decode included)",
    "reward_wait": "reward, not hidden",
    "old_log_prob": "old log-prob",
    "update": "update",
    "weight_sync": "weight version bump",
    "validation": "validation",
}


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _memory(part: dict) -> str:
    allocated, reserved = part.get("peak_memory_gb"), part.get("peak_memory_reserved_gb")
    if allocated is None:
        return "n/a (CPU)"
    return f"{allocated:.1f} GiB" + (f" ({reserved:.1f} GiB reserved)" if reserved is not None else "")


def train_lines(data: dict) -> list[str]:
    """The result as a markdown table and a few lines: each phase of flowrl's and the peer's step
    against its FLOP limit, the whole step, memory and the projection."""
    s = data.get("settings", {})
    weights = f"random weights ({s['random_weights']})" if s.get("random_weights") else s.get("model")
    gpu = data.get("environment", {}).get("gpu") or data.get("environment", {}).get("device")
    lines = [
        f"### {s.get('config')}, {weights}, {s.get('samples_per_step')} samples per step "
        f"({s.get('prompts_per_step')} prompts x {s.get('n')}), {s.get('steps')} steps, {shape_label(s)}, "
        f"{s.get('trained_steps_per_sample')} trained steps per sample, LoRA rank {s.get('lora_rank')}, "
        f"micro-batch {s.get('micro_batch_size')}, {'compiled' if s.get('compile') else 'eager'}, {gpu}",
        "",
    ]
    flowrl, peer = data.get("flowrl", {}), data.get("peer", {})
    if not flowrl.get("phases") and not peer.get("phases"):
        return lines + ["(no timed step finished)", ""]
    lines += ["| phase | flowrl s | limit s | flowrl MFU | peer s | peer MFU |", "|---|---|---|---|---|---|"]
    for phase, label in _PHASE_LABELS.items():
        mine, theirs = flowrl.get("phases", {}).get(phase), peer.get("phases", {}).get(phase)
        if mine is None and theirs is None:
            continue
        ref = mine or theirs
        lines.append(
            f"| {label} | {_cell(mine and mine['seconds'], '.2f')} | {ref['limit_seconds']:.2f} "
            f"| {_cell(mine and mine['mfu'], '.1%')} | {_cell(theirs and theirs['seconds'], '.2f')} "
            f"| {_cell(theirs and theirs['mfu'], '.1%')} |"
        )
    ref = flowrl if flowrl.get("phases") else peer
    lines.append(
        f"| **training step** (validation apart) | {_cell(flowrl.get('step_seconds'), '.2f')} "
        f"| {ref['limit_seconds']:.2f} | {_cell(flowrl.get('mfu'), '.1%')} | {_cell(peer.get('step_seconds'), '.2f')} "
        f"| {_cell(peer.get('mfu'), '.1%')} |"
    )
    lines.append("")
    if flowrl.get("phases"):
        lines.append(
            f"- flowrl: {flowrl['images_per_second']:.3f} {sample_unit(s)}/s over the whole step, {flowrl['step_over_limits']:.2f} x "
            f"the sum of its phases' limits, peak GPU memory {_memory(flowrl)}"
        )
    alone = flowrl.get("rollout_alone_seconds")
    if alone is not None and flowrl.get("phases", {}).get("rollout"):
        lines.append(
            f"- the rollout alone (no reward or step around it): {alone:.2f} s, against "
            f"{flowrl['phases']['rollout']['seconds']:.2f} s as the step's phase"
        )
    warmup = flowrl.get("warmup")
    if warmup:
        shown = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in warmup["seconds"].items())
        lines.append(f"- flowrl's first step (it compiles): {warmup['step_seconds']:.1f} s ({shown})")
    if peer.get("phases"):
        lines.append(
            f"- peer (pipeline calls of {peer.get('batch')} samples, per-timestep backward): "
            f"{peer['images_per_second']:.3f} {sample_unit(s)}/s, {peer['step_over_limits']:.2f} x the limits, peak GPU memory "
            f"{_memory(peer)}"
        )
    if data.get("peer_over_flowrl"):
        lines.append(f"- the peer's training step takes {data['peer_over_flowrl']:.2f} x flowrl's")
    p = data.get("projection")
    if p:
        lines.append(
            f"- {p['total_steps']} steps of this recipe at {p['recipe_samples_per_step']} samples per step (scaled "
            f"linearly in samples): about {p['hours_at_recipe_size']:.1f} h on this GPU, "
            f"{p['hours_at_recipe_size_on_gpus']:.1f} h on {p['gpus']} GPUs if the step splits without loss"
        )
    if peer.get("error"):
        lines.append(f"- the peer's loop failed: {peer['error']}")
    if data.get("error"):
        lines.append(f"- error: {data['error']}")
    return lines + [""]
