"""`flowrl bench learn`: how fast configurations learn, on held-out prompts, against a control.

    flowrl bench learn --config recipes/toy_cpu_full.yaml --steps 30 --eval-every 10 \\
        --run 'full:' --run 'lora: trainer.lora.enabled=true trainer.lr=3e-3' --out outputs/learn

Every configuration is a name and a list of `key=value` overrides on top of the recipe (and of the
overrides common to all). Each trains for `--steps` steps (with `--seconds`, at most that many
device-seconds: scored once more where the budget ends) and, unless `--no-control`,
once more as its control (`algorithm.shuffle_advantages=true`: the same updates' sizes, with the
advantages detached from the images; with `--seconds`, for the steps its configuration reached). At step 0 and every `--eval-every` steps the held-out
prompts (data.val_path, or --prompts) are sampled with the run's validation settings and weights
(ODE, seeds from rollout.val_seed, `--eval-seeds` per prompt; trainer.ema's average when on) and
scored with the run's reward; each of its components (the toy world's `partial` and `strict`)
gets a mean and a 95% interval over the prompts (each prompt's mean over its seeds, as
`flowrl eval` reports). Device-seconds are the training steps' wall time (evaluation excluded)
times the devices used. Writes OUT/learn.json (every point, and every image's scores) and
OUT/learn.png (each component against steps and against device-seconds, configurations side by
side, controls dashed, intervals shaded), and prints a summary: base, final and control values,
the gain over the base with its paired 95% interval (prompt by prompt, the same seeds), whether
the final interval clears the control's, and when each curve first reaches the first
configuration's final value. `--jobs K` measures the runs in up to K processes at once
(flowrl.bench.learn_jobs), for models that leave the device mostly idle. A run stopped early
(Ctrl-C, SIGTERM: a job's time limit) keeps what it measured: learn.json is rewritten after every
evaluation (`"complete": false` until the end), and the stopped command writes the report and the
summary of the points measured, each configuration and its control cut to their common steps,
and exits with 128 + the signal. `--train-seeds S1,S2,...`
trains every configuration at each seed and adds a comparison pooled over them
(flowrl.bench.learn_seeds).

It drives Trainer.train_step and the evaluation path of `flowrl eval` (flowrl.eval.inference.
sample_rows, flowrl.eval.evaluate); it adds no training logic.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowrl.bench.learn_seeds import clears, parse_seeds, pooled_comparison, pooled_lines, seeded

LEARN_MARKER = "bench-learn"
CONTROL_OVERRIDE = "algorithm.shuffle_advantages=true"
# What every measured run is, whatever the recipe says: no validation, checkpoints, tensorboard or bar
# of the trainer's own (bench learn evaluates), a fresh start in a folder of the bench's.
_BENCH_OVERRIDES = (
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.resume=never",
    "trainer.overwrite=true",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
)


@dataclass(frozen=True)
class RunSpec:
    """One measured run: a configuration's name and overrides, as itself or as its control."""

    name: str
    overrides: tuple[str, ...]
    control: bool = False

    @property
    def label(self) -> str:
        return f"{self.name} (control)" if self.control else self.name

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name) + ("-control" if self.control else "")


def parse_run(text: str) -> tuple[str, tuple[str, ...]]:
    """'NAME: key=value key=value' -> (NAME, overrides); ValueError naming the text otherwise."""
    name, separator, rest = text.partition(":")
    name = name.strip()
    if not separator or not name:
        raise ValueError(f"--run {text!r} must be 'NAME: key=value ...' (e.g. 'lora: trainer.lora.enabled=true')")
    overrides = tuple(shlex.split(rest))
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise ValueError(f"--run {text!r}: {bad[0]!r} is not a key=value override")
    return name, overrides


def expand_runs(
    configurations: list[tuple[str, tuple[str, ...]]], control: bool, trained: bool = True
) -> list[RunSpec]:
    """Each configuration (when `trained`), followed by its control (when `control`)."""
    names = [name for name, _ in configurations]
    if len(set(names)) != len(names):
        raise ValueError(f"--run names must differ: {names}")
    runs = []
    for name, overrides in configurations:
        if trained:
            runs.append(RunSpec(name, overrides))
        if control:
            runs.append(RunSpec(name, overrides, control=True))
    return runs


def evaluation_steps(total: int, every: int) -> list[int]:
    """0, every, 2 every, ..., and `total` itself."""
    if every < 1:
        raise ValueError(f"--eval-every {every} must be >= 1")
    return sorted({0, total, *range(every, total + 1, every)})


@dataclass
class HeldOut:
    """The held-out evaluation: prompt rows, seeds per prompt, sampling and the reward."""

    rows: list[dict]
    samples_per_prompt: int
    params: object  # SamplingParams (ODE)
    seed: int
    reward: object

    def score(self, engine) -> dict[str, np.ndarray]:
        """{component: (num_prompts, samples_per_prompt) scores} of the engine's current weights."""
        from flowrl.eval.evaluate import score_images
        from flowrl.eval.inference import sample_rows

        columns: dict[str, list[np.ndarray]] = {}
        n = self.samples_per_prompt
        for first, images, seeds in sample_rows(engine, self.rows, n, self.params, self.seed):
            chunk = [self.rows[first + k // n] for k in range(len(seeds))]
            for name, scores in score_images({"reward": self.reward}, images, chunk).items():
                columns.setdefault(name, []).append(scores)
        scores = {name: np.concatenate(parts).reshape(len(self.rows), n) for name, parts in columns.items()}
        components = {name.split("/", 1)[1]: s for name, s in scores.items() if "/" in name}
        return components or {"reward": scores["reward"]}


def _summary(scores: dict[str, np.ndarray]) -> dict:
    from flowrl.eval.evaluate import interval, per_prompt_means

    return {name: interval(per_prompt_means(values)) for name, values in scores.items()}


def _load_run_config(config_path: str, common: list[str], spec: RunSpec, steps: int, out: Path):
    from flowrl.run.config import load_train_config

    overrides = [*common, *spec.overrides, *([CONTROL_OVERRIDE] if spec.control else [])]
    fixed = [*_BENCH_OVERRIDES, f"trainer.total_steps={steps}", f"trainer.output_dir={out / 'runs' / spec.folder}"]
    return load_train_config(config_path, [*overrides, *fixed]), overrides


def _baseline_key(cfg, held_out: HeldOut) -> str:
    """Runs with equal keys start from the same weights and are scored alike (the same prompts,
    seeds, sampling and reward), so they share their step-0 evaluation (LoRA with a
    zero-initialised B changes nothing before the first update)."""
    from flowrl.config import config_to_dict

    lora = cfg.trainer.lora
    zero_start = not lora.enabled or lora.init in ("default", "gaussian")
    parts = [
        config_to_dict(cfg.model),
        config_to_dict(cfg.engine),
        config_to_dict(cfg.rollout.val_sampling),
        cfg.rollout.val_seed,
        config_to_dict(cfg.reward),
        held_out.rows,
        held_out.samples_per_prompt,
    ]
    return json.dumps(parts, sort_keys=True, default=str) if zero_start else f"unique-{id(cfg)}"


def measure_run(
    cfg,
    spec: RunSpec,
    steps: list[int],
    held_out: HeldOut,
    baselines: dict,
    say=print,
    seconds: float | None = None,
    on_point=None,
) -> dict:
    """Train `cfg` to max(steps), scoring the held-out prompts at each of `steps`; with `seconds`,
    stop once the training steps have taken that many device-seconds and score that step last.
    `on_point(run)`: called with the run as measured so far after each scored step."""
    from flowrl.trainer.trainer import Trainer

    points, images, train_rewards = [], {}, []
    device_seconds = 0.0
    with Trainer(cfg) as trainer:
        devices = trainer.world.size
        for target in steps:
            while trainer.step < target and (seconds is None or device_seconds < seconds):
                metrics = trainer.train_step()
                device_seconds += metrics["timing/step_s"] * devices
                train_rewards.append(metrics.get("reward/mean"))
                trainer.log(trainer.step, metrics)  # the run's own metrics.jsonl, as `flowrl train` writes it
            out_of_time = trainer.step < target
            if out_of_time and points and points[-1]["step"] == trainer.step:
                break  # the budget ran out right after the last scored step
            target = trainer.step
            key = _baseline_key(cfg, held_out)
            if target == 0 and key in baselines:
                scores = baselines[key]
            else:
                with trainer.validation_weights():  # what the run validates with: trainer.ema's average, if on
                    scores = held_out.score(trainer.engine)
                if target == 0:
                    baselines[key] = scores
            summary = _summary(scores)
            points.append({"step": target, "device_seconds": device_seconds, "scores": summary})
            images[str(target)] = {name: values.tolist() for name, values in scores.items()}
            shown = ", ".join(f"{name} {value['mean']:.3f}" for name, value in summary.items())
            say(f"  {spec.label}: step {target} ({device_seconds:.0f} device-s): {shown}")
            if on_point is not None:
                on_point(_run_record(spec, points, train_rewards, images))
            if out_of_time:
                break
    return _run_record(spec, points, train_rewards, images)


def _run_record(spec: RunSpec, points: list, train_rewards: list, images: dict) -> dict:
    return {
        "name": spec.name,
        "label": spec.label,
        "control": spec.control,
        "points": list(points),
        "train_reward": list(train_rewards),
        "images": dict(images),
    }


def run_learning(
    config_path: str,
    configurations: list[tuple[str, tuple[str, ...]]],
    steps: int,
    eval_every: int,
    out: str | Path,
    common: list[str] = (),
    prompts: str | None = None,
    num_prompts: int | None = None,
    samples_per_prompt: int = 2,
    control: bool = True,
    say=print,
    seconds: float | None = None,
    trained: bool = True,
    baselines: dict | None = None,
) -> dict:
    """Measure every configuration (and its control); returns the report `learn.json` holds. With
    `seconds`, each configuration trains for at most that many device-seconds (and `steps`), and its
    control for exactly the steps the configuration reached, scored at the same steps. `baselines`:
    step-0 evaluations to share with the caller's other calls (a dict it keeps; filled here)."""
    from flowrl.data.prompts import load_prompt_rows
    from flowrl.rewards import build_reward_from_config

    out = Path(out)
    runs = expand_runs(list(configurations), control, trained)
    at = evaluation_steps(steps, eval_every)
    first_cfg, _ = _load_run_config(config_path, list(common), runs[0], steps, out)
    path = prompts or first_cfg.data.val_path
    if path is None:
        raise ValueError("no held-out prompts: set data.val_path in the recipe or pass --prompts FILE")
    rows = load_prompt_rows(path, first_cfg.data.prompt_field, num_prompts, "--prompts" if prompts else "data.val_path")
    report = {
        "config": str(config_path),
        "common_overrides": list(common),
        "steps": steps,
        "eval_steps": at,
        "prompts": str(path),
        "num_prompts": len(rows),
        "samples_per_prompt": samples_per_prompt,
        "interval": "95% normal approximation over prompts (each prompt's mean over its seeds)",
        "device_seconds": "wall time of the training steps (evaluation excluded) x devices",
        "seconds": seconds,
        "complete": False,  # until every run is measured: learn.json is rewritten after each point
        "runs": [],
    }
    baselines = {} if baselines is None else baselines
    current: dict = {}  # the overrides of the run being measured

    def so_far(run: dict) -> None:  # the report as measured so far, this run included
        write_json(out / "learn.json", {**report, "runs": [*report["runs"], {**run, **current}]})

    for spec in runs:
        cfg, overrides = _load_run_config(config_path, list(common), spec, steps, out)
        current["overrides"] = overrides
        held_out = HeldOut(
            rows,
            samples_per_prompt,
            cfg.rollout.val_sampling,
            cfg.rollout.val_seed,
            build_reward_from_config(cfg.reward),
        )
        say(f"{spec.label}: {' '.join(overrides) or '(the recipe as it is)'}")
        if spec.control and seconds is not None:  # the configuration's own steps, paired step by step
            reached = next(r for r in report["runs"] if r["name"] == spec.name and not r["control"])
            steps_at = [p["step"] for p in reached["points"]]
            measured = measure_run(cfg, spec, steps_at, held_out, baselines, say, on_point=so_far)
        else:
            measured = measure_run(cfg, spec, at, held_out, baselines, say, seconds, on_point=so_far)
        report["runs"].append({**measured, "overrides": overrides})
    report["complete"] = True
    return report


def write_json(path: Path, report: dict) -> None:
    """`report` as `path`, replaced whole (a reader, or a process killed meanwhile, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(staged, path)


def common_steps(report: dict, seed_groups: dict | None = None) -> dict:
    """A stopped report with each configuration's runs (it and its control; with `seed_groups`,
    those of every seed of it) cut to the steps all of them reached, so that finals compare the
    same step."""
    runs = report["runs"]
    group_of = {member: name for name, members in (seed_groups or {}).items() for member in members}

    def key(run: dict) -> str:
        return group_of.get(run["name"], run["name"])

    last = {}
    for run in runs:
        reached = run["points"][-1]["step"] if run["points"] else -1
        last[key(run)] = min(last.get(key(run), reached), reached)
    cut = []
    for run in runs:
        points = [p for p in run["points"] if p["step"] <= last[key(run)]]
        if points:
            kept = {str(p["step"]) for p in points}
            cut.append(
                {**run, "points": points, "images": {k: v for k, v in run.get("images", {}).items() if k in kept}}
            )
    return {**report, "runs": cut}


def final_comparison(report: dict) -> list[dict]:
    """Per configuration and component: base, final and control intervals, and whether the final
    interval lies above both the control's and the base's."""
    rows = []
    runs = report["runs"]
    for run in (r for r in runs if not r["control"]):
        control = next((r for r in runs if r["control"] and r["name"] == run["name"]), None)
        for component, final in run["points"][-1]["scores"].items():
            base = run["points"][0]["scores"][component]
            entry = {"name": run["name"], "component": component, "base": base, "final": final}
            entry["gain"] = final["mean"] - base["mean"]
            entry["gain_interval"] = _paired_gain(run, component, report.get("samples_per_prompt", 1))
            if control is not None:
                entry["control"] = control["points"][-1]["scores"][component]
                entry["above_control"] = clears(final, entry["control"])
                entry["control_gap_interval"] = _paired_gap(
                    run, control, component, report.get("samples_per_prompt", 1)
                )
            entry["above_base"] = clears(final, base)
            rows.append(entry)
    return rows


def _paired_gain(run: dict, component: str, samples_per_prompt: int) -> dict | None:
    """The final minus the base score, prompt by prompt (the same prompts and seeds): mean and 95%
    interval, tighter than comparing the two intervals; None without the per-image scores."""
    steps = sorted(run.get("images", {}), key=int)
    if len(steps) < 2:
        return None
    return _paired(run["images"][steps[-1]], run["images"][steps[0]], component, samples_per_prompt)


def _paired_gap(run: dict, control: dict, component: str, samples_per_prompt: int) -> dict | None:
    """The run's final score minus its control's, prompt by prompt (paired as `_paired_gain`)."""
    mine, theirs = run.get("images", {}), control.get("images", {})
    if not mine or not theirs:
        return None
    return _paired(mine[max(mine, key=int)], theirs[max(theirs, key=int)], component, samples_per_prompt)


def _paired(upper: dict, lower: dict, component: str, samples_per_prompt: int) -> dict | None:
    from flowrl.eval.evaluate import interval, per_prompt_means

    if component not in upper or component not in lower:
        return None
    a, b = (np.asarray(side[component], dtype=np.float64).reshape(-1, samples_per_prompt) for side in (upper, lower))
    return interval(per_prompt_means(a) - per_prompt_means(b))


def first_reach(points: list[dict], component: str, level: float) -> dict | None:
    """The first evaluated point whose mean reaches `level`, or None."""
    return next((p for p in points if p["scores"][component]["mean"] >= level), None)


def summary_lines(report: dict) -> list[str]:
    lines = []
    fmt = lambda s: f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]" if s["ci95"] else f"{s['mean']:.3f}"
    for entry in final_comparison(report):
        gain = entry["gain_interval"]
        shown = f"{entry['gain']:+.3f}" + (
            f" [{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}]" if gain and gain["ci95"] else ""
        )
        text = f"{entry['name']} {entry['component']}: base {fmt(entry['base'])} -> {fmt(entry['final'])} ({shown})"
        if "control" in entry:
            verdict = "above its control" if entry["above_control"] else "NOT above its control"
            gap = entry["control_gap_interval"]
            paired = f" (paired gap [{gap['ci95'][0]:+.3f}, {gap['ci95'][1]:+.3f}])" if gap and gap["ci95"] else ""
            text += f"; control {fmt(entry['control'])}: {verdict}{paired}"
        lines.append(text)
    trained = [r for r in report["runs"] if not r["control"]]
    if trained:  # how soon each curve reaches what the first configuration gained by its end
        reference = trained[0]
        for component, final in reference["points"][-1]["scores"].items():
            level = final["mean"]
            if level <= reference["points"][0]["scores"][component]["mean"]:
                continue
            for run in report["runs"]:
                point = first_reach(run["points"], component, level)
                where = "never" if point is None else f"step {point['step']}, {point['device_seconds']:.0f} device-s"
                lines.append(f"reaches {reference['name']}'s final {component} {level:.3f}: {run['label']} at {where}")
    return lines


def write_report(report: dict, out: Path) -> tuple[Path, Path | None]:
    from flowrl.bench.learn_plot import plot_learning

    json_path = out / "learn.json"
    write_json(json_path, report)
    png = plot_learning(report, out / "learn.png")
    return json_path, png


def run_learn(args) -> int:
    """The `flowrl bench learn` command (module docstring)."""
    from flowrl.bench.learn_jobs import JobFailed
    from flowrl.output_paths import OutputExistsError, check_output_folder, file_sizes, write_marker

    out = Path(args.out)
    try:
        check_output_folder(out, LEARN_MARKER, args.overwrite)
        configurations = [parse_run(text) for text in args.run] or [("flowgrpo", ())]
        if args.controls_only and (args.no_control or args.seconds is not None):
            raise ValueError(
                "--controls-only measures the controls alone: it takes neither --no-control nor --seconds "
                "(a control under --seconds trains the steps its configuration reached)"
            )
        groups = None
        if args.train_seeds is not None:
            configurations, groups = seeded(configurations, parse_seeds(args.train_seeds))
        expand_runs(configurations, not args.no_control)  # name clashes, before anything loads
        start = time.perf_counter()
        if args.jobs > 1:
            for name, overrides in configurations:  # a bad override is named before any process starts
                _load_run_config(args.config, list(args.overrides), RunSpec(name, overrides), args.steps, out)
        (out / "learn.json").unlink(missing_ok=True)  # an earlier report: a stop must not read it as this one's
        with stop_signals() as stopped:
            report = _measure(args, configurations, out)
    except (OutputExistsError, ValueError, JobFailed) as error:
        print(f"flowrl bench learn: error: {error}", file=sys.stderr)
        return 2
    if not report["complete"]:
        if not report["runs"]:
            print(f"flowrl bench learn: stopped by {stopped.name} before any point was measured", file=sys.stderr)
            return 128 + stopped.number
        report = common_steps(report, groups)
    report["wall_seconds"] = time.perf_counter() - start
    if groups is not None:
        report["seed_groups"] = groups
        report["pooled"] = pooled_comparison(report)
    json_path, png = write_report(report, out)
    write_marker(out, LEARN_MARKER, list(file_sizes(out)))
    if not report["complete"]:
        print(
            f"flowrl bench learn: stopped by {stopped.name}: the report holds the points measured before it, "
            "each configuration and its control cut to their common steps",
            file=sys.stderr,
        )
    for line in summary_lines(report) + pooled_lines(report):
        print(line)
    print(f"report: {json_path}" + (f"; plot: {png}" if png else ""))
    return 0 if report["complete"] else 128 + stopped.number


class _Stop:
    """The signal that stopped the command (SIGINT unless SIGTERM came first)."""

    number = signal.SIGINT
    name = "SIGINT"


@contextlib.contextmanager
def stop_signals():
    """SIGTERM (a job's time limit) raises KeyboardInterrupt as Ctrl-C does, in the main thread; the
    yielded object names the signal once one came."""
    stop = _Stop()

    def on_sigterm(signum, frame):
        stop.number, stop.name = signal.SIGTERM, "SIGTERM"
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        yield stop
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _measure(args, configurations: list, out: Path) -> dict:
    """The report of every run (run_learning, or run_jobs with --jobs); stopped by a signal, what
    was measured until then (`"complete": false`)."""
    from flowrl.bench.learn_jobs import run_jobs

    if args.jobs > 1:
        return run_jobs(args, configurations, out)
    try:
        return run_learning(
            args.config,
            configurations,
            args.steps,
            args.eval_every or max(1, args.steps // 3),
            out,
            common=list(args.overrides),
            prompts=args.prompts,
            num_prompts=args.eval_prompts,
            samples_per_prompt=args.eval_seeds,
            control=not args.no_control,
            seconds=args.seconds,
            trained=not args.controls_only,
        )
    except KeyboardInterrupt:
        saved = out / "learn.json"  # rewritten after every point
        return json.loads(saved.read_text()) if saved.is_file() else {"complete": False, "runs": []}
