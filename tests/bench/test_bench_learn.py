"""`flowrl bench learn`: its arguments are checked before anything loads, its verdicts follow the
intervals, and a short run on the committed toy model writes the report and the plot with every
configuration, its control and their shared step-0 evaluation."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from flowrl.bench.learn import evaluation_steps, expand_runs, final_comparison, parse_run
from flowrl.cli import main


def test_run_specs_and_evaluation_steps():
    assert parse_run("lora: trainer.lora.enabled=true trainer.lr=1e-3") == (
        "lora",
        ("trainer.lora.enabled=true", "trainer.lr=1e-3"),
    )
    assert parse_run("full:") == ("full", ())
    for bad in ("no colon", ": x=1", "name: notanoverride"):
        with pytest.raises(ValueError, match="--run"):
            parse_run(bad)
    with pytest.raises(ValueError, match="must differ"):
        expand_runs([("a", ()), ("a", ("x=1",))], control=True)
    runs = expand_runs([("a", ()), ("b", ("x=1",))], control=True)
    assert [run.label for run in runs] == ["a", "a (control)", "b", "b (control)"]
    assert evaluation_steps(10, 4) == [0, 4, 8, 10]
    assert evaluation_steps(3, 5) == [0, 3]


def _point(step, mean, half):
    return {
        "step": step,
        "device_seconds": step,
        "scores": {"partial": {"mean": mean, "ci95": [mean - half, mean + half]}},
    }


def test_verdicts_follow_the_intervals():
    report = {
        "runs": [
            {"name": "a", "label": "a", "control": False, "points": [_point(0, 0.3, 0.02), _point(9, 0.5, 0.03)]},
            {
                "name": "a",
                "label": "a (control)",
                "control": True,
                "points": [_point(0, 0.3, 0.02), _point(9, 0.46, 0.02)],
            },
            {"name": "b", "label": "b", "control": False, "points": [_point(0, 0.3, 0.02), _point(9, 0.5, 0.03)]},
            {
                "name": "b",
                "label": "b (control)",
                "control": True,
                "points": [_point(0, 0.3, 0.02), _point(9, 0.3, 0.02)],
            },
        ]
    }
    a, b = final_comparison(report)
    assert a["gain"] == pytest.approx(0.2) and a["above_base"] and not a["above_control"]  # 0.47 < 0.48
    assert b["above_control"] and b["above_base"]


def _short_learn(out) -> list[str]:
    return [
        "bench", "learn", "--config", "recipes/toy_cpu_full.yaml", "--steps", "1", "--eval-every", "1",
        "--eval-prompts", "4", "--eval-seeds", "1", "--out", str(out),
        "--run", "full:", "--run", "lora: trainer.lora.enabled=true trainer.lora.rank=4",
        "trainer.prompts_per_step=2", "rollout.n=2", "rollout.sampling.num_inference_steps=3",
    ]  # fmt: skip


def test_a_short_learning_run_writes_report_and_plot(tmp_path, capsys):
    out = tmp_path / "learn"
    assert main(_short_learn(out)) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "learn.json").read_text())
    assert (out / "learn.png").stat().st_size > 0
    assert [run["label"] for run in report["runs"]] == ["full", "full (control)", "lora", "lora (control)"]
    assert all([p["step"] for p in run["points"]] == [0, 1] for run in report["runs"])
    # Every run starts from the same weights (LoRA's B is zero), so they share one step-0 evaluation.
    starts = [run["points"][0]["scores"] for run in report["runs"]]
    assert all(start == starts[0] for start in starts) and set(starts[0]) == {"partial", "strict"}
    assert all(len(run["images"]["1"]["partial"]) == 4 for run in report["runs"])  # 4 prompts x 1 seed
    assert "full partial: base" in printed and "control" in printed
    # A unit that fails is named with its log, and the others are stopped.
    capsys.readouterr()
    failing = [sys.executable, "-c", "print('the cause'); raise SystemExit(2)"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("flowrl.bench.learn_jobs.job_command", lambda *args: failing)
        assert main([*_short_learn(tmp_path / "fails"), "--jobs", "2"]) == 2
    assert "exited with 2; see" in (err := capsys.readouterr().err) and "the cause" in err
    # The folder is the bench's now: a second run into it is allowed, a folder of something else is not.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert main(_short_learn(other)) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_step_0_evaluations_are_shared_only_between_runs_scored_alike(tmp_path, monkeypatch):
    """A run whose reward differs gets its own step-0 evaluation; a later call given the same
    `baselines` reuses the first call's for the same model, prompts, seeds and reward."""
    from flowrl.bench.learn import HeldOut, run_learning

    scored = []
    original = HeldOut.score
    monkeypatch.setattr(HeldOut, "score", lambda self, engine: scored.append(1) or original(self, engine))
    tiny = ["trainer.prompts_per_step=2", "rollout.n=2", "rollout.sampling.num_inference_steps=3"]
    runs = [("a", ()), ("b", ("reward.options={score: strict}",))]
    shared: dict = {}

    def learn(configurations, out):
        return run_learning(
            "recipes/toy_cpu_full.yaml", configurations, 1, 1, tmp_path / out, tiny, num_prompts=2,
            samples_per_prompt=1, control=False, say=lambda _: None, baselines=shared,
        )  # fmt: skip

    first = learn(runs, "one")
    assert len(scored) == 4  # a: step 0 and 1; b: its own step 0 (another reward) and 1
    again = learn(runs[:1], "two")
    assert len(scored) == 5  # a's step 1 only
    assert again["runs"][0]["points"][0] == first["runs"][0]["points"][0]


@pytest.mark.slow  # two more processes; the fast siblings: test_jobs_split_runs_into_units, the failing unit above
def test_jobs_measure_what_one_process_measures(tmp_path):
    """Measured by two processes at once (--jobs 2, one per configuration), the joined report holds
    the same runs, in order, with the same scores as one process's."""
    assert main([*_short_learn(tmp_path / "one"), "--no-control"]) == 0
    assert main([*_short_learn(tmp_path / "jobs"), "--jobs", "2", "--no-control"]) == 0
    alone, joined = (json.loads((tmp_path / name / "learn.json").read_text()) for name in ("one", "jobs"))
    assert joined["jobs"] == 2 and (tmp_path / "jobs" / "learn.png").stat().st_size > 0
    assert [run["label"] for run in joined["runs"]] == [run["label"] for run in alone["runs"]] == ["full", "lora"]
    assert [run["images"] for run in joined["runs"]] == [run["images"] for run in alone["runs"]]


def test_bad_override_is_named_before_anything_trains(tmp_path, capsys):
    code = main(
        ["bench", "learn", "--config", "recipes/toy_cpu_full.yaml", "--out", str(tmp_path / "o"), "--run", "x: nokey"]
    )
    assert code == 2 and "'nokey' is not a key=value override" in capsys.readouterr().err
    # With --jobs, an unknown key is named by the command itself, before any process starts.
    args = ["bench", "learn", "--config", "recipes/toy_cpu_full.yaml", "--out", str(tmp_path / "j"), "--jobs", "2"]
    assert main([*args, "--run", "x: trainer.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err and not (tmp_path / "j" / "jobs").exists()


def test_a_seconds_budget_stops_the_run_and_its_control_trains_as_many_steps(tmp_path, capsys):
    """--seconds: the configuration stops once its steps took the budget (here after its first step)
    and is scored there; its control trains exactly those steps, scored at the same steps."""
    out = tmp_path / "budget"
    with_budget = lambda seconds: [
        "bench", "learn", "--config", "recipes/toy_cpu_full.yaml", "--steps", "5", "--eval-every", "1",
        "--seconds", seconds, "--eval-prompts", "4", "--eval-seeds", "1", "--out", str(out), "--run", "full:",
        "trainer.prompts_per_step=2", "rollout.n=2", "rollout.sampling.num_inference_steps=3",
    ]  # fmt: skip
    assert main(with_budget("1e-6")) == 0
    report = json.loads((out / "learn.json").read_text())
    assert report["seconds"] == 1e-6
    assert [[p["step"] for p in run["points"]] for run in report["runs"]] == [[0, 1], [0, 1]]
    assert [run["label"] for run in report["runs"]] == ["full", "full (control)"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(with_budget("0"))
    assert "must be a finite number > 0" in capsys.readouterr().err


def test_jobs_split_runs_into_units():
    """Each configuration and each control is a process of its own, except under --seconds (a
    control trains the steps its configuration reached) and with --no-control / --controls-only."""
    from types import SimpleNamespace

    from flowrl.bench.learn_jobs import job_units

    configs = [("a", ()), ("b", ("x=1",))]
    args = lambda **kw: SimpleNamespace(**{"no_control": False, "controls_only": False, "seconds": None, **kw})
    assert [which for _, which in job_units(args(), configs)] == ["trained", "controls", "trained", "controls"]
    assert [which for _, which in job_units(args(seconds=5.0), configs)] == ["both", "both"]
    assert [which for _, which in job_units(args(no_control=True), configs)] == ["trained", "trained"]
    assert [which for _, which in job_units(args(controls_only=True), configs)] == ["controls", "controls"]


def test_train_seeds_expand_each_configuration_and_refuse_a_seed_of_its_own():
    from flowrl.bench.learn_seeds import parse_seeds, seeded

    assert parse_seeds("42,1,2") == [42, 1, 2]
    for bad in ("42", "1,1", "a,b", ""):
        with pytest.raises(ValueError, match="--train-seeds"):
            parse_seeds(bad)
    runs, groups = seeded([("full", ("trainer.lr=1e-4",))], [42, 1])
    assert runs == [
        ("full@s42", ("trainer.lr=1e-4", "trainer.seed=42", "rollout.seed=42")),
        ("full@s1", ("trainer.lr=1e-4", "trainer.seed=1", "rollout.seed=1")),
    ]
    assert groups == {"full": ["full@s42", "full@s1"]}
    with pytest.raises(ValueError, match="'rollout.seed=3'"):
        seeded([("full", ("rollout.seed=3",))], [42, 1])


def _seed_run(name, control, base, final):
    """A report run whose per-image partial scores are `base` at step 0 and `final` at step 2."""
    return {"name": name, "control": control, "images": {"0": {"partial": base}, "2": {"partial": final}}}


def test_pooled_comparison_averages_prompts_over_seeds():
    """Two seeds, two prompts, two samples a prompt: each figure against numbers worked by hand."""
    from flowrl.bench.learn_seeds import pooled_comparison, t_interval

    base = [0.4, 0.6, 0.2, 0.2]  # prompt means 0.5, 0.2
    report = {
        "samples_per_prompt": 2,
        "seed_groups": {"full": ["full@s1", "full@s2"]},
        "runs": [
            _seed_run("full@s1", False, base, [0.6, 0.8, 0.3, 0.3]),  # prompt means 0.7, 0.3
            _seed_run("full@s1", True, base, [0.4, 0.4, 0.1, 0.1]),  # 0.4, 0.1
            _seed_run("full@s2", False, base, [0.5, 0.5, 0.4, 0.4]),  # 0.5, 0.4
            _seed_run("full@s2", True, base, [0.5, 0.5, 0.2, 0.2]),  # 0.5, 0.2
        ],
    }
    (entry,) = pooled_comparison(report)
    assert entry["seeds"] == 2 and entry["final"]["mean"] == pytest.approx(0.475)  # prompts 0.6, 0.35
    assert entry["base"]["mean"] == pytest.approx(0.35) and entry["control"]["mean"] == pytest.approx(0.3)
    assert entry["gain_interval"]["mean"] == pytest.approx(0.125)  # by prompt: 0.1, 0.15
    half = 1.959963984540054 * np.std([0.1, 0.15], ddof=1) / np.sqrt(2)
    assert entry["gain_interval"]["ci95"] == pytest.approx([0.125 - half, 0.125 + half])
    # by seed: seed 1 gains (0.2 + 0.1) / 2 = 0.15, seed 2 (0.0 + 0.2) / 2 = 0.1; t with 1 degree of freedom
    assert entry["gain_over_seeds"]["ci95"] == pytest.approx([0.125 - 12.706 * 0.025, 0.125 + 12.706 * 0.025])
    assert entry["control_gap_over_seeds"]["mean"] == pytest.approx(0.175)  # 0.25 and 0.1
    assert t_interval([1.0, 2.0, 3.0])["ci95"] == pytest.approx([2 - 4.303 / np.sqrt(3), 2 + 4.303 / np.sqrt(3)])


def test_a_short_run_over_two_training_seeds_reports_the_pooled_comparison(tmp_path, capsys):
    out = tmp_path / "learn"
    argv = _short_learn(out)
    argv = [*argv[: argv.index("--run")], "--run", "full:", "--train-seeds", "1,2", *argv[argv.index("--run") + 4 :]]
    assert main(argv) == 0
    report = json.loads((out / "learn.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["full@s1", "full@s1 (control)", "full@s2", "full@s2 (control)"]
    assert report["seed_groups"] == {"full": ["full@s1", "full@s2"]}
    assert {entry["component"] for entry in report["pooled"]} == {"partial", "strict"}
    assert "full over 2 seeds, partial: base" in capsys.readouterr().out
    assert main([*_short_learn(tmp_path / "bad"), "--train-seeds", "3"]) == 2
    assert "--train-seeds='3'" in capsys.readouterr().err


def test_a_stopped_report_compares_each_configuration_at_its_common_step():
    from flowrl.bench.learn import common_steps
    from flowrl.bench.learn_jobs import join_reports

    run = {"name": "a", "label": "a", "control": False, "points": [_point(s, 0.3, 0.02) for s in (0, 2, 4)]}
    run["images"] = {"0": {}, "2": {}, "4": {}}
    control = {"name": "a", "label": "a (control)", "control": True, "points": [_point(s, 0.3, 0.02) for s in (0, 2)]}
    report = {"complete": False, "device_seconds": "x", "runs": [run, control]}
    cut = common_steps(report)
    assert [[p["step"] for p in r["points"]] for r in cut["runs"]] == [[0, 2], [0, 2]]
    assert list(cut["runs"][0]["images"]) == ["0", "2"]
    # Seeds of one configuration are cut together: the pooled comparison compares one step.
    other = {**run, "name": "a@s1", "label": "a@s1", "points": [_point(s, 0.3, 0.02) for s in (0, 2, 4, 6)]}
    seeded = {**report, "runs": [{**run, "name": "a@s42"}, other]}
    cut = common_steps(seeded, {"a": ["a@s42", "a@s1"]})
    assert [[p["step"] for p in r["points"]] for r in cut["runs"]] == [[0, 2, 4], [0, 2, 4]]
    finished = {**report, "complete": True}
    assert join_reports([finished, finished], 2, complete=True)["complete"]
    assert not join_reports([finished, report], 2, complete=True)["complete"]
    assert not join_reports([finished], 2, complete=False)["complete"]
    assert join_reports([], 2, complete=False) == {"complete": False, "runs": []}


def test_sigterm_keeps_what_the_jobs_measured(tmp_path):
    """A time limit's SIGTERM to `bench learn --jobs 2` stops both units; the command writes the
    report of the points they measured, the run and its control cut to their common steps, prints
    the summary and exits 143."""
    import signal
    import subprocess
    import time

    out = tmp_path / "stopped"
    command = [
        sys.executable, "-m", "flowrl.cli", "bench", "learn", "--config", "recipes/toy_cpu_full.yaml", "--steps", "200",
        "--eval-every", "1", "--eval-prompts", "2", "--eval-seeds", "1", "--out", str(out), "--jobs", "2",
        "--run", "full:", "trainer.prompts_per_step=1", "rollout.n=2", "rollout.sampling.num_inference_steps=2",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    units = [out / "jobs" / f"unit-{i}" / "learn.json" for i in (0, 1)]

    def points(path):
        try:
            return len(json.loads(path.read_text())["runs"][0]["points"])
        except (OSError, ValueError, IndexError, KeyError):
            return 0

    deadline = time.monotonic() + 120
    while min(points(unit) for unit in units) < 2 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    report = json.loads((out / "learn.json").read_text())
    assert not report["complete"] and [run["label"] for run in report["runs"]] == ["full", "full (control)"]
    steps = [[p["step"] for p in run["points"]] for run in report["runs"]]
    assert steps[0] == steps[1] and len(steps[0]) >= 2 and steps[0][-1] < 200
    assert "stopped by SIGTERM" in stderr and "full partial: base" in stdout
