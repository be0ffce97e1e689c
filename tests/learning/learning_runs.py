"""The learning tests' one measurement: a toy recipe trained against its control with `flowrl bench
learn`'s code, at one seed or pooled over several, reduced to its partial-score comparison."""

from __future__ import annotations

from flowrl.bench.learn import final_comparison, run_learning
from flowrl.bench.learn_seeds import pooled_comparison, seeded

SHOWN = ("base", "final", "control", "gain_interval", "control_gap_interval")


def learned(
    recipe: str, name: str, steps: int, tmp_path, seeds=None, samples_per_prompt: int = 1, baselines=None
) -> tuple[dict, dict]:
    """(the partial score's final comparison, what to show when an assertion fails) of
    `recipes/<recipe>.yaml` trained `steps` steps against its control; with `seeds`, one run per
    training seed and the comparison pooled over them (flowrl.bench.learn_seeds)."""
    configurations, groups = seeded([(name, ())], list(seeds)) if seeds else ([(name, ())], None)
    report = run_learning(
        f"recipes/{recipe}.yaml", configurations, steps, steps, tmp_path, samples_per_prompt=samples_per_prompt,
        say=lambda _: None, baselines=baselines,
    )  # fmt: skip
    if groups is None:
        comparison = final_comparison(report)
    else:
        report["seed_groups"] = groups
        comparison = pooled_comparison(report)
    partial = next(entry for entry in comparison if entry["component"] == "partial")
    return partial, {key: partial[key] for key in SHOWN}
