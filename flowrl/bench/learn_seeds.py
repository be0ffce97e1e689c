"""`flowrl bench learn --train-seeds S1,S2,...`: every configuration trained at several seeds, and
one comparison pooled over them.

A run's held-out score moves with its training seed (which prompts each step draws, the rollouts'
noise) about as much as a small configuration change moves it, and one run's interval covers the
held-out prompts, not that. With --train-seeds each --run becomes one run per seed, named
`NAME@sS`, with `trainer.seed` and `rollout.seed` set to S (the held-out evaluation keeps
`rollout.val_seed`, so every seed is scored on the same samples' noise). The report then adds, per
configuration and score (`pooled` in learn.json, printed after the per-run lines):

- each held-out prompt's score averaged over the seeds (and evaluation samples): base, final and
  control, with 95% intervals over prompts, and whether the final one clears the other two;
- the final minus the base and minus the control prompt by prompt (paired, over prompts);
- the same two differences averaged per seed, with a Student t interval over the seeds (few seeds
  make a normal interval too narrow).
"""

from __future__ import annotations

import math

import numpy as np

SEED_KEYS = ("trainer.seed", "rollout.seed")
# Two-sided 95% critical values of Student's t by degrees of freedom (1-30); the normal's beyond.
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def clears(upper: dict, lower: dict) -> bool:
    """Whether `upper`'s 95% interval lies entirely above `lower`'s."""
    if upper["ci95"] is None or lower["ci95"] is None:
        return False
    return upper["ci95"][0] > lower["ci95"][1]


def parse_seeds(text: str) -> list[int]:
    """'42,1,2' -> [42, 1, 2]; ValueError naming the flag for anything else (repeats, fewer than 2)."""
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"--train-seeds={text!r} must be comma-separated integers, e.g. 42,1,2") from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--train-seeds={text!r} must name at least two different seeds, e.g. 42,1,2")
    return seeds


def seeded(configurations: list[tuple[str, tuple[str, ...]]], seeds: list[int]) -> tuple[list, dict]:
    """(one configuration per (configuration, seed), {configuration name: its seeded names})."""
    runs, groups = [], {}
    for name, overrides in configurations:
        clash = [item for item in overrides if item.split("=", 1)[0].strip() in SEED_KEYS]
        if clash:
            raise ValueError(
                f"--run {name!r} sets {clash[0]!r}, which --train-seeds sets for every seed; drop one of the two"
            )
        groups[name] = [f"{name}@s{seed}" for seed in seeds]
        runs += [(f"{name}@s{seed}", (*overrides, *(f"{key}={seed}" for key in SEED_KEYS))) for seed in seeds]
    return runs, groups


def t_interval(values) -> dict:
    """Mean and Student t 95% interval of `values` (one per seed)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    if values.size < 2:
        return {"mean": mean, "ci95": None, "n": int(values.size)}
    critical = T_975[values.size - 2] if values.size - 1 <= len(T_975) else 1.96
    half = critical * float(values.std(ddof=1)) / math.sqrt(values.size)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": int(values.size)}


def _per_prompt(run: dict, step: str, component: str, samples_per_prompt: int) -> np.ndarray:
    from flowrl.eval.evaluate import per_prompt_means

    scores = np.asarray(run["images"][step][component], dtype=np.float64)
    return per_prompt_means(scores.reshape(-1, samples_per_prompt))


def _last(run: dict) -> str:
    return max(run["images"], key=int)


def pooled_comparison(report: dict) -> list[dict]:
    """Per configuration of report["seed_groups"] and component: the module docstring's figures."""
    from flowrl.eval.evaluate import interval

    samples = report.get("samples_per_prompt", 1)
    by_name = {(run["name"], run["control"]): run for run in report["runs"]}
    rows = []
    for name, members in report.get("seed_groups", {}).items():
        trained = [by_name[(member, False)] for member in members if (member, False) in by_name]
        controls = [by_name.get((run["name"], True)) for run in trained]
        if not trained or not all(len(run.get("images", {})) >= 2 for run in trained):
            continue
        for component in trained[0]["images"]["0"]:
            base = np.stack([_per_prompt(run, "0", component, samples) for run in trained])
            final = np.stack([_per_prompt(run, _last(run), component, samples) for run in trained])
            entry = {"name": name, "component": component, "seeds": len(trained)}
            entry["base"], entry["final"] = interval(base.mean(0)), interval(final.mean(0))
            entry["gain_interval"] = interval((final - base).mean(0))
            entry["gain_over_seeds"] = t_interval((final - base).mean(1))
            entry["above_base"] = clears(entry["final"], entry["base"])
            if all(control is not None and control.get("images") for control in controls):
                control = np.stack([_per_prompt(c, _last(c), component, samples) for c in controls])
                entry["control"] = interval(control.mean(0))
                entry["control_gap_interval"] = interval((final - control).mean(0))
                entry["control_gap_over_seeds"] = t_interval((final - control).mean(1))
                entry["above_control"] = clears(entry["final"], entry["control"])
            rows.append(entry)
    return rows


def pooled_lines(report: dict) -> list[str]:
    """One printed line per pooled entry."""

    def shown(stat: dict, signed: bool = False) -> str:
        sign = "+" if signed else ""
        ci = stat["ci95"]
        return f"{stat['mean']:{sign}.3f}" + (f" [{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]" if ci else "")

    lines = []
    for entry in report.get("pooled", []):
        text = (
            f"{entry['name']} over {entry['seeds']} seeds, {entry['component']}: base {shown(entry['base'])} -> "
            f"{shown(entry['final'])} (gain by prompt {shown(entry['gain_interval'], True)}, "
            f"by seed {shown(entry['gain_over_seeds'], True)})"
        )
        if "control" in entry:
            verdict = "above its control" if entry["above_control"] else "NOT above its control"
            text += (
                f"; control {shown(entry['control'])}: {verdict} (gap by prompt "
                f"{shown(entry['control_gap_interval'], True)}, by seed {shown(entry['control_gap_over_seeds'], True)})"
            )
        lines.append(text)
    return lines
