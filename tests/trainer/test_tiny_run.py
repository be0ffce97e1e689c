"""The embedded tiny run, shortened: the reward really rises, and the loop writes what it promises.
Plus the one CLI smoke test of `flowrl train` (a subprocess running the real entry point)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.config import config_to_dict, load_config
from flowrl.run.config import load_train_config

REPO = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = (
    "step",
    "reward/mean",
    "reward/std",
    "actor/policy_loss",
    "actor/clipfrac",
    "actor/ratio_mean",
    "actor/ratio_max",
    "actor/approx_kl",
    "actor/kl",
    "actor/grad_norm",
    "actor/logprob_gap_mean",
    "actor/logprob_gap_max",
    "adv/zero_std_ratio",
    "timing/rollout_s",
    "timing/update_s",
    "timing/step_s",
)


def test_tiny_run_reward_rises(build_trainer, make_cfg):
    # The embedded default with fewer steps (the full run has 60) and one validation at the end.
    cfg = make_cfg("trainer.total_steps=12", "trainer.val_every=12", "trainer.save_every=12")
    summary = build_trainer(cfg).fit()
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for key in REQUIRED_KEYS:
        assert key in steps[-1], key
    # The within-step reward std is ~0.0025 and a control run with shuffled advantages moves the
    # other way (-0.0035 in 60 steps); the trained run gains ~0.035 in 12 steps.
    gain = summary["last5_reward_mean"] - summary["first5_reward_mean"]
    assert gain > 0.01, summary
    assert all(r["rollout/policy_lag"] == 0 for r in steps)  # colocated: rollouts use the latest weights
    assert [r["rollout/policy_version"] for r in steps] == list(range(12))
    assert Path(summary["reward_curve"]).is_file()
    out = Path(cfg.trainer.output_dir)
    assert (out / "val" / "step_000000.png").is_file() and (out / "val" / "step_000012.png").is_file()
    assert (out / "final" / "transformer" / "config.json").is_file()


def test_tiny_recipe_is_the_embedded_default():
    assert config_to_dict(load_config(str(REPO / "recipes" / "tiny_cpu.yaml"))) == config_to_dict(
        load_train_config(None, [])
    )


def test_real_recipes_load_with_their_group_sizes():
    recipes = {
        "sd35_medium_ocr_lora": (16, "ocr"),
        "sd35_large_ocr_lora": (16, "ocr"),
        "qwen_image_ocr_lora": (16, "ocr"),
        "z_image_ocr_lora": (16, "ocr"),
        "flux_dev_pickscore_lora": (24, "pickscore"),  # Flow-GRPO's FLUX group size
    }
    for name, (group_size, reward) in recipes.items():
        cfg = load_config(str(REPO / "recipes" / f"{name}.yaml"))
        assert cfg.rollout.n == group_size and cfg.rollout.enable_batched_diffusion
        assert cfg.trainer.lora.enabled and cfg.reward.name == reward
        # Compiled: the trainer's log-prob values then come from the rollout's graph (docs/training.md).
        assert cfg.engine.compile


def test_cli_smoke(tiny_sd3_path, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowrl.cli",
            "train",
            f"model.path={tiny_sd3_path}",
            f"trainer.output_dir={tmp_path / 'out'}",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.save_every=2",
            "logging.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mean reward, first 5 steps:" in result.stdout and "mean reward, last 5 steps:" in result.stdout
    # A model of the user's own is not announced as the embedded tiny run (it was, without --config).
    assert "embedded tiny CPU run" not in result.stdout + result.stderr
    assert (tmp_path / "out" / "checkpoints" / "step_000002" / "state.json").is_file()
    assert (tmp_path / "out" / "tensorboard").is_dir()


def _quoted(path: Path, pattern: str) -> list[float]:
    import re

    match = re.search(pattern, " ".join(path.read_text().split()))
    assert match, f"{path.name} no longer says {pattern!r}"
    return [float(value) for value in match.groups()]


@pytest.mark.slow
def test_the_docs_quote_what_the_embedded_tiny_run_produces(tmp_path, monkeypatch, capsys):
    """The docs' figures of the tiny run (`flowrl train` with no arguments) are the run's:
    the first and last 5 steps' mean reward, the best validation step, and docs/evaluation.md's
    table of `flowrl eval --run` (issue 52). Minutes: the 12-step test above is its fast sibling."""
    from flowrl.cli import main
    from flowrl.data.prompts import TINY_PROMPTS

    monkeypatch.chdir(tmp_path)  # the README's command, as a new user runs it: outputs/ here
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "outputs"))
    assert main(["train", "logging.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    first5, last5 = (float(line.split(":")[1]) for line in printed.splitlines() if line.startswith("mean reward"))
    for doc in (REPO / "docs" / "training.md",):
        assert _quoted(doc, r"from about (-0\.\d+) to about (-0\.\d+)") == [round(first5, 2), round(last5, 2)], doc
    records = [json.loads(line) for line in (tmp_path / "outputs/tiny-run/metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/reward_mean"] for r in records if "val/reward_mean" in r}
    assert max(val, key=val.get) == 40 and val[60] < val[40]  # "best at step 40, falls back a little"
    assert _quoted(REPO / "docs" / "training.md", r"best at step 40 \(about (-0\.\d+)\)") == [round(val[40], 3)]

    (tmp_path / "prompts.txt").write_text("\n".join(TINY_PROMPTS) + "\n")
    assert main(["eval", "--run", "outputs/tiny-run", "--prompts", "prompts.txt", "--out", "eval"]) == 0
    printed_table = capsys.readouterr().out

    def means(text: str) -> dict[str, float]:
        rows = [line.split() for line in text.splitlines() if line.startswith(("base ", "step_0000"))]
        return {row[0]: float(row[1]) for row in rows}

    documented = means((REPO / "docs" / "evaluation.md").read_text())
    measured = means(printed_table)
    assert documented.keys() == measured.keys() == {"base", "step_000020", "step_000040", "step_000060"}
    # Within the rounding a thread count makes over 60 steps (the table is a 2-thread run's; xdist
    # workers run one thread each): a few thousandths at most.
    assert all(abs(documented[k] - measured[k]) < 0.005 for k in documented), (documented, printed_table)
