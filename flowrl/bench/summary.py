"""Summarize `flowrl bench` JSON files as markdown (the form of docs/performance.md's rows).

    python -m flowrl.bench.summary OUT/*.json

Prints, per rollout file, one row per mode (img/s, MFU, s/run, rows per forward, peak memory) with
the limit and ratios; per logprob file the gap per micro-batch and the training step; per train
file the phases of the whole step against their limits, flowrl's and the peer's. Missing or
partial files (a run cut short) are summarized as far as they go; a file another script wrote
(benchmarks/) is named and left to that script's own printout.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def ms_list(seconds: list[float]) -> str:
    """'267, 272, 330': every timed run in ms, so a figure's spread shows next to its median."""
    return ", ".join(f"{s * 1000:.0f}" for s in seconds)


def lora_label(settings: dict) -> str:
    """'LoRA rank R, ' for a rollout run with an adapter (settings['lora_rank'] > 0), else ''."""
    return f"LoRA rank {settings['lora_rank']}, " if settings.get("lora_rank") else ""


def _steps_per_forward(settings: dict) -> str:
    """' at S trained steps per forward' where the update scored several at once, else ""."""
    steps = settings.get("steps_per_forward", 1)
    return f" at {steps} trained steps per forward" if steps and steps > 1 else ""


def _activation_budget(settings: dict) -> str:
    """', activation memory budget X' where the training graphs kept less than torch's default."""
    budget = settings.get("activation_memory_budget", 1.0)
    return f", activation memory budget {budget:g}" if budget is not None and budget < 1.0 else ""


def _gpu(data: dict) -> str:
    env = data.get("environment", {})
    return env.get("gpu") or env.get("device", "?")


def _compiled_label(settings: dict) -> str:
    if not settings.get("compile"):
        return "eager"
    return f"compiled (rounding {settings['compile_rounding']})" if settings.get("compile_rounding") else "compiled"


def rollout_markdown(name: str, data: dict) -> list[str]:
    s = data.get("settings", {})
    compiled = any(mode.endswith("-compiled") for mode in data.get("modes", {}))
    rounding = f", compile rounding {s['compile_rounding']}" if compiled and s.get("compile_rounding") else ""
    lines = [
        f"### {name}: {s.get('model')}, {s.get('num_samples')} samples, {s.get('steps')} steps, "
        f"{s.get('size')}px, guidance {s.get('guidance_scale')}, {s.get('dtype')}{rounding}, "
        f"{lora_label(s)}{_gpu(data)}",
        "",
    ]
    flops, peak = data.get("flops"), data.get("peak")
    if flops and peak and flops.get("per_image"):
        lines.append(
            f"Matmul peak {peak['burst_flops'] / 1e12:.0f} TFLOP/s burst, {peak['sustained_flops'] / 1e12:.0f} sustained; "
            f"{flops['transformer_per_row'] / 1e12:.3f} TFLOP per row-forward, {flops['decode_per_image'] / 1e12:.3f} per decode; "
            f"limit {flops['limit_images_per_second_sustained']:.3f} img/s (sustained) / "
            f"{flops['limit_images_per_second_burst']:.3f} (burst)."
        )
        lines.append("")
    lines += ["| mode | img/s | MFU | s/run | rows/forward | peak GB |", "|---|---|---|---|---|---|"]
    for mode, m in data.get("modes", {}).items():
        if "error" in m:
            lines.append(f"| {mode} | error: {m['error'][:80]} | | | | |")
            continue
        mem = f"{m['peak_memory_gb']:.1f}" if m.get("peak_memory_gb") is not None else "-"
        mfu = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "-"
        lines.append(
            f"| {mode} | {m['images_per_second']:.3f} | {mfu} | {m['seconds_median']:.2f} | "
            f"{m.get('mean_rows_per_forward', 0):.1f} | {mem} |"
        )
    for label, value in data.get("ratios", {}).items():
        lines.append(f"- {label}: {value:.3f}")
    profile = data.get("profile")
    if profile and profile.get("share_by_category"):
        lines += _profile_markdown(profile, profile["mode"], top=5)
    return lines + [""]


def busy_text(profile: dict, wall: str) -> str:
    """', GPU busy X% of <wall>' (kernel time over the timed wall time), else the share of the
    profiled span (flowrl.bench.report.busy_within_span), else ''. Shared by both printouts."""
    span = profile.get("busy_within_span")
    if profile.get("gpu_busy") is not None:
        return f", GPU busy {profile['gpu_busy']:.0%} of {wall}"
    return f", GPU busy {span['share']:.1%} of the profiled {span['span_ms']:.0f} ms" if span else ""


def idle_gap_texts(span: dict) -> tuple[str, list[str]]:
    """('GPU idle A ms of the profiled B in N gaps', one text per listed gap) of a busy_within_span result."""
    head = f"GPU idle {span['span_ms'] - span['busy_ms']:.1f} ms of the profiled {span['span_ms']:.0f} in {span['gaps']} gaps"
    return head, [
        f"{g['ms']:.2f} ms at {g['at_ms']:.1f} ms (after {g['after']}, before {g['before']})"
        for g in span.get("longest_gaps", [])
    ]


def _profile_markdown(profile: dict, label: str, top: int) -> list[str]:
    """A profile_summary result as markdown lines: the share per kernel category (and how busy
    the GPU was, when measured), then the top kernels and the longest idle gaps."""
    shares = ", ".join(f"{c} {v:.0%}" for c, v in profile["share_by_category"].items())
    lines = [
        f"- profile of {label} ({profile['clock']} time {profile['total_ms']:.0f} ms"
        f"{busy_text(profile, 'the step')}): {shares}"
    ] + [
        f"  - {k['share']:.1%} {k['ms']:.1f} ms x{k['calls']} {k['name']}" for k in profile.get("top_kernels", [])[:top]
    ]
    span = profile.get("busy_within_span")
    if span and span.get("longest_gaps"):
        head, gaps = idle_gap_texts(span)
        lines.append(f"  - {head}, the longest: " + "; ".join(gaps))
    return lines


def logprob_markdown(name: str, data: dict) -> list[str]:
    s = data.get("settings", {})
    lines = [
        f"### {name}: {s.get('model')}, {s.get('num_samples')} samples, {s.get('steps')} steps, {s.get('size')}px, "
        f"guidance {s.get('guidance_scale')}, {s.get('dtype')}, LoRA rank {s.get('lora_rank')}, "
        f"autocast {s.get('autocast', 'no')}, {_compiled_label(s)}, {_gpu(data)}",
        "",
        "| trainer micro-batch | trainer's values from | mean abs gap | max abs gap | no-grad pass mean / max "
        "| grad pass mean / max |",
        "|---|---|---|---|---|---|",
    ]
    for g in data.get("gaps", []):
        if "error" in g:
            lines.append(f"| {g['micro_batch']} | {g['error']} | | | | |")
        else:
            passes = " | ".join(
                f"{g[p]['mean_abs_diff']:.2e} / {g[p]['max_abs_diff']:.2e}" if p in g else "-"
                for p in ("no_grad_pass", "grad_pass")
            )
            lines.append(
                f"| {g['micro_batch']} | {g.get('trainer_values_from', 'grad pass')} | {g['mean_abs_diff']:.2e} "
                f"| {g['max_abs_diff']:.2e} | {passes} |"
            )
    for t in data.get("training_steps", []):
        if "error" in t and "seconds_median" not in t:
            lines.append(f"- training step, micro-batch {t['micro_batch']}: {t['error']}")
            continue
        flops, counted = t.get("flops_forward_backward"), t.get("flops_counted_at_micro_batch")
        scaled = f" (counted at micro-batch {counted}, scaled)" if counted not in (None, t["micro_batch"]) else ""
        work = (
            f"{flops / 1e12:.1f} TFLOP fwd+bwd{scaled}, MFU {(t.get('mfu') or 0):.1%}" if flops else "FLOPs not counted"
        )
        lines.append(
            f"- training step, micro-batch {t['micro_batch']}: {t['seconds_median'] * 1000:.0f} ms "
            f"(runs: {ms_list(t.get('seconds', []))}), {work}, peak {t['peak_memory_gb'] or 0:.0f} GB"
            f"{', gradient checkpointing' if s.get('gradient_checkpointing') else ''}"
            f"{', old_log_prob recompute' if s.get('old_log_prob') == 'recompute' else ''}"
            f"{'; then failed: ' + t['error'] if 'error' in t else ''}"
        )
        profile = t.get("profile")
        if profile and profile.get("share_by_category"):
            lines += _profile_markdown(profile, f"the training step (micro-batch {t['micro_batch']})", top=8)
    return lines + [""]


# phase -> its row label in the train table (flowrl.bench.train.PHASE_METRICS's order)
_PHASE_LABELS = {
    "rollout": "rollout (decode included)",
    "reward_wait": "reward, not hidden behind the rollout",
    "old_log_prob": "old log-prob (recompute)",
    "update": "update",
    "weight_sync": "weight version bump",
    "validation": "validation",
}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _checkpointing(steps: list[dict]) -> str:
    """', gradient checkpointing (...)' as flowrl's timed steps ran, '' when off or unknown."""
    if not steps or steps[-1].get("gradient_checkpointing") is None:
        return ""
    per_sample = steps[-1].get("activations_per_sample_gb")
    measured = f", {per_sample:.2f} GB of activations per sample without" if per_sample is not None else ""
    state = "on" if steps[-1]["gradient_checkpointing"] else "off"
    return f", gradient checkpointing {state}{measured}"


def _memory(loop: dict) -> str:
    """'X GB allocated, Y GB reserved' of a loop's timed steps: CUDA graph pools show only in the reserved peak."""
    allocated = f"{_cell(loop.get('peak_memory_gb'), '.1f')} GB"
    reserved = loop.get("peak_memory_reserved_gb")
    return allocated if reserved is None else f"{allocated} allocated, {reserved:.1f} GB reserved"


def _cuda_graphs(flowrl: dict) -> str:
    """', training graphs as CUDA graphs (N not graphed)' when the trainer ran them ('' otherwise)."""
    if not flowrl.get("cuda_graphs"):
        return ""
    skips = flowrl.get("cuda_graph_skips")
    return ", training graphs as CUDA graphs" + ("" if not skips else f" ({skips} graphs inductor could not graph)")


def _early_recompute(steps: list[dict]) -> str:
    """', N% of the recompute scored while the rewards were computed' of the last timed step ('' without a recompute)."""
    share = steps[-1].get("old_log_prob_early_share") if steps else None
    return "" if share is None else f", {share:.0%} of the recompute scored while the rewards were computed"


def _merged_rollout_units(units: dict) -> str:
    """' (the rollout's on merged LoRA weights X, a merge Y)' when the rollout merged (rollout.merge_lora)."""
    merge = units.get("merge_per_rollout")
    if not merge:
        return ""
    return f" (the rollout's on merged LoRA weights {units['rollout_forward_per_row'] / 1e12:.3f}, a merge {merge / 1e12:.3f})"


def _lora_merge(steps: list[dict]) -> str:
    """', the LoRA merge X s of the rollout' (median of the timed steps; '' without rollout.merge_lora)."""
    seconds = [s["lora_merge_seconds"] for s in steps if s.get("lora_merge_seconds") is not None]
    return "" if not seconds else f", the LoRA merge {statistics.median(seconds):.3f} s of the rollout"


def _ms_list(ops: list[dict]) -> str:
    return ", ".join(f"{op['name']} {op['ms']:.1f}" for op in ops) or "none"


def _gap_classes(classes: list[dict] | None) -> str:
    """'; by gap length: up to 0.1 ms 1200 gaps 40 ms, ...' of step_profile.idle_by_gap_length ('' without)."""
    if not classes:
        return ""

    def label(c: dict) -> str:
        return f"over {classes[-2]['up_to_ms']:g}" if c["up_to_ms"] is None else f"up to {c['up_to_ms']:g}"

    texts = [f"{label(c)} ms {c['gaps']} gaps {c['idle_ms']:.0f} ms" for c in classes if c["gaps"]]
    return "; by gap length: " + ", ".join(texts)


def kernels_after_gaps_text(kernels: list[dict] | None) -> str:
    """'; gaps of 0.1 ms or more, by the kernel that ended them (...): NAME N gaps X ms (after NAME;
    launched in OP), ...' of step_profile.kernels_after_gaps ('' without)."""
    if not kernels:
        return ""

    def context(k: dict) -> str:
        parts = [f"after {k['after']}"] if k.get("after") else []
        parts += [f"launched in {k['launched_by']}"] if k.get("launched_by") else []
        return f" ({'; '.join(parts)})" if parts else ""

    return (
        "; gaps of 0.1 ms or more, by the kernel that ended them (the kernel most often before them; the host op "
        "that most often launched it): "
        + ", ".join(f"{k['name']} {k['gaps']} gaps {k['ms']:.1f} ms{context(k)}" for k in kernels)
    )


def launch_split_text(split: dict | None) -> str:
    """'; those gaps by their kernel's launch call: returned before the gap N gaps X ms, ...' of
    step_profile.long_gaps_by_launch ('' without)."""
    if not split or not any(v["gaps"] for v in split.values()):
        return ""
    queued, launched, unmatched = split["queued_before_gap"], split["launched_in_gap"], split["unmatched"]
    text = (
        f"; those gaps by their kernel's launch call: returned before the gap began {queued['gaps']} gaps "
        f"{queued['ms']:.1f} ms, returned inside it {launched['gaps']} gaps {launched['ms']:.1f} ms (the calls "
        f"themselves {launched['launch_call_ms']:.1f} ms of it)"
    )
    return text + (f", no call found {unmatched['gaps']} gaps {unmatched['ms']:.1f} ms" if unmatched["gaps"] else "")


def _gc_pauses(steps: list[dict]) -> str:
    """'Python GC paused X s a step (N full collections)' of the timed steps (median; '' when not measured)."""
    pauses = [s["gc_pauses"] for s in steps if s.get("gc_pauses")]
    if not pauses:
        return ""
    seconds = statistics.median([p["seconds"] for p in pauses])
    full = statistics.median([p["full_collections"] for p in pauses])
    return f"; Python's garbage collector paused {seconds:.2f} s a step ({full:g} full collections)"


def _allocator(steps: list[dict]) -> str:
    """'; the CUDA caching allocator's last step: N cudaMalloc, ...' ('' off a GPU or unmeasured)."""
    counts = (steps[-1].get("allocator") or {}) if steps else {}
    if not counts:
        return ""
    return (
        f"; the CUDA caching allocator's last step: {counts['num_device_alloc']} cudaMalloc, "
        f"{counts['num_device_free']} cudaFree, {counts['num_alloc_retries']} cache flushes"
    )


# A profiled phase this much slower than unprofiled: the profiler's own host work shows in its split
PROFILER_SLOWDOWN_FLAGGED = 0.10


def profiled_time_text(profiled_ms: float, unprofiled_seconds: float | None) -> str:
    """' (unprofiled N ms, +x%)' for a profiled phase, with a warning where the profile ran more
    than PROFILER_SLOWDOWN_FLAGGED slower: its gaps then overstate how long the GPU waits on the
    host ('' where the phase was not timed unprofiled)."""
    if not unprofiled_seconds:
        return ""
    slower = profiled_ms / (unprofiled_seconds * 1e3) - 1
    text = f" (unprofiled {unprofiled_seconds * 1e3:.0f} ms, {slower:+.1%}"
    if slower > PROFILER_SLOWDOWN_FLAGGED:
        text += ": the profiler's own host work slowed it, so its gaps overstate the waits on the host"
    return text + ")"


def _step_profile_lines(profile: dict | None, timed_phases: dict) -> list[str]:
    """flowrl.bench.step_profile's result, a line per phase, each against the timed steps' median
    of that phase (`timed_phases`, summarize's phases); '' without a profile."""
    if not profile:
        return []
    if "error" in profile:
        return [f"- the profiled step failed: {profile['error']}"]
    lines = []
    for phase, p in profile["phases"].items():
        unprofiled = timed_phases.get(phase, {}).get("seconds")
        head = (
            f"- profiled step, {_PHASE_LABELS.get(phase, phase)}: {p['wall_ms']:.0f} ms"
            f"{profiled_time_text(p['wall_ms'], unprofiled)}"
        )
        if "gpu_busy" not in p:
            lines.append(f"{head}; host ops by their own CPU time (ms): {_ms_list(p['host_ops_self_ms'])}")
            continue
        longest = ", ".join(f"{ms:.2f}" for ms in p["longest_gaps_ms"])
        shares = ", ".join(f"{c} {v:.0%}" for c, v in p["share_by_category"].items())
        lines.append(
            f"{head}, GPU busy {p['gpu_busy']:.1%} (idle {p['idle_ms']:.0f} ms in {p['gaps']} gaps, the longest "
            f"{longest} ms{_gap_classes(p.get('idle_by_gap_length'))}); kernels: {shares}; host ops running while "
            f"the GPU idled (ms, callees included): {_ms_list(p['host_ops_in_idle_ms'])}"
            f"{kernels_after_gaps_text(p.get('kernels_after_long_gaps_ms'))}{launch_split_text(p.get('long_gaps_by_launch'))}"
        )
    return lines


def train_markdown(name: str, data: dict) -> list[str]:
    """A `flowrl bench train` result: the phases of flowrl's and the peer's step against their
    FLOP limits, the whole step, memory and the projection."""
    s = data.get("settings", {})
    weights = f"random weights ({s['random_weights']})" if s.get("random_weights") else s.get("model")
    lines = [
        f"### {name}: {s.get('config')}, {weights}, {s.get('samples_per_step')} samples per step "
        f"({s.get('prompts_per_step')} prompts x {s.get('n')}), {s.get('steps')} steps, {s.get('size')}px, guidance "
        f"{s.get('guidance_scale')}, {s.get('trained_steps_per_sample')} trained steps per sample, LoRA rank "
        f"{s.get('lora_rank')}, micro-batch {s.get('micro_batch_size')}{_steps_per_forward(s)}{_activation_budget(s)}, "
        f"{'compiled' if s.get('compile') else 'eager'}, "
        f"{_gpu(data)}",
        "",
    ]
    peak, units = data.get("peak"), data.get("flops")
    if peak and units:
        lines += [
            f"Matmul peak {peak['sustained_flops'] / 1e12:.0f} TFLOP/s sustained; {units['forward_per_row'] / 1e12:.3f} "
            f"TFLOP per row-forward{_merged_rollout_units(units)}, {units['decode_per_image'] / 1e12:.3f} per decode, "
            f"{units['train_per_sample_step'] / 1e12:.3f} per sample-step of forward + backward.",
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
    lines.append(
        f"| other (advantages, host work) | {_cell(flowrl.get('other_seconds'), '.2f')} | | "
        f"| {_cell(peer.get('other_seconds'), '.2f')} | |"
    )
    ref = flowrl if flowrl.get("phases") else peer
    lines.append(
        f"| **training step** (validation apart) | {_cell(flowrl.get('step_seconds'), '.2f')} | {ref['limit_seconds']:.2f} "
        f"| {_cell(flowrl.get('mfu'), '.1%')} | {_cell(peer.get('step_seconds'), '.2f')} | {_cell(peer.get('mfu'), '.1%')} |"
    )
    lines.append("")
    if flowrl.get("phases"):
        lines.append(
            f"- flowrl: {flowrl['images_per_second']:.3f} img/s over the whole step, {flowrl['step_over_limits']:.2f} x "
            f"the sum of its phases' limits, peak GPU memory {_memory(flowrl)}"
            f"{_checkpointing(flowrl.get('steps', []))}{_cuda_graphs(flowrl)}{_early_recompute(flowrl.get('steps', []))}"
            f"{_lora_merge(flowrl.get('steps', []))}"
            f"{_gc_pauses(flowrl.get('steps', []))}{_allocator(flowrl.get('steps', []))}"
        )
    alone = flowrl.get("rollout_alone_seconds")
    if alone is not None and flowrl.get("phases", {}).get("rollout"):
        lines.append(
            f"- the rollout alone (the trainer's engine, one more rollout of a step's prompts with no reward or step "
            f"around it): {alone:.2f} s, against {flowrl['phases']['rollout']['seconds']:.2f} s as the step's phase"
        )
    warmup = flowrl.get("warmup")
    if warmup:
        lines.append(
            f"- flowrl's first step (it compiles, as a run's first step does): {warmup['step_seconds']:.1f} s ("
            + ", ".join(f"{phase} {s:.1f}" for phase, s in warmup["seconds"].items())
            + ")"
        )
    lines += _step_profile_lines(flowrl.get("profile"), flowrl.get("phases", {}))
    if peer.get("phases"):
        lines.append(
            f"- peer (pipeline calls of {peer.get('batch')} samples, per-timestep backward): "
            f"{peer['images_per_second']:.3f} img/s, {peer['step_over_limits']:.2f} x the limits, peak GPU memory "
            f"{_memory(peer)}{', gradient checkpointing' if peer.get('gradient_checkpointing') else ''}"
        )
    if data.get("peer_over_flowrl"):
        lines.append(f"- the peer's training step takes {data['peer_over_flowrl']:.2f} x flowrl's")
    p = data.get("projection")
    if p:
        val = "validation included" if p["validation_included"] else "validation not timed, left out"
        lines.append(
            f"- {p['total_steps']} steps of this recipe as run ({p['samples_per_step']} samples per step, {val}): about "
            f"{p['hours']:.1f} h on this GPU"
        )
        if p["recipe_samples_per_step"] != p["samples_per_step"]:
            lines.append(
                f"- at the recipe file's {p['recipe_samples_per_step']} samples per step (time scaled linearly in "
                f"samples): about {p['hours_at_recipe_size']:.1f} h on this GPU"
            )
        lines.append(
            f"- with {p['gpus']} GPUs about {p['hours_at_recipe_size_on_gpus']:.1f} h, if the step splits across them "
            "without loss (not measured)"
        )
    if peer.get("error"):
        lines.append(f"- the peer's loop failed: {peer['error']}")
    if data.get("error"):
        lines.append(f"- error: {data['error']}")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"### {path.name}: unreadable ({exc})\n")
            continue
        markdown = {"rollout": rollout_markdown, "logprob": logprob_markdown, "train": train_markdown}.get(
            data.get("benchmark")
        )
        if markdown is None:
            print(f"### {path.stem}: not a `flowrl bench` result (benchmark {data.get('benchmark')!r}); see its log\n")
            continue
        print("\n".join(markdown(path.stem, data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
