"""The plot of `flowrl bench learn`: each score component against steps and against
device-seconds, one colour per configuration, its control dashed, 95% intervals shaded."""

from __future__ import annotations

from pathlib import Path


def plot_learning(report: dict, path: str | Path) -> Path | None:
    """Write the PNG; None when matplotlib is missing or nothing was measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = report["runs"]
    if not runs or not runs[0]["points"]:
        return None
    components = list(runs[0]["points"][0]["scores"])
    names = list(dict.fromkeys(run["name"] for run in runs))
    colours = {name: f"C{index}" for index, name in enumerate(names)}
    figure, axes = plt.subplots(len(components), 2, figsize=(11, 3.6 * len(components)), squeeze=False)
    for row, component in enumerate(components):
        for column, x_key in enumerate(("step", "device_seconds")):
            axis = axes[row][column]
            for run in runs:
                xs = [point[x_key] for point in run["points"]]
                stats = [point["scores"][component] for point in run["points"]]
                means = [s["mean"] for s in stats]
                style = "--" if run["control"] else "-"
                axis.plot(xs, means, style, marker="o", color=colours[run["name"]], label=run["label"])
                lows = [s["ci95"][0] if s["ci95"] else s["mean"] for s in stats]
                highs = [s["ci95"][1] if s["ci95"] else s["mean"] for s in stats]
                axis.fill_between(xs, lows, highs, color=colours[run["name"]], alpha=0.12 if run["control"] else 0.22)
            axis.set_xlabel("training step" if x_key == "step" else "device-seconds (training only)")
            axis.set_ylabel(f"held-out {component}")
            axis.grid(alpha=0.3)
        axes[row][0].legend(fontsize=8)
    figure.suptitle(
        f"{Path(report['config']).name}: {report['num_prompts']} held-out prompts x {report['samples_per_prompt']} "
        "seeds, 95% intervals",
        fontsize=10,
    )
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
