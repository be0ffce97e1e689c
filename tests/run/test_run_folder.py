"""One folder, one run: a new run in a used folder is refused (or cleaned with trainer.overwrite),
`flowrl train` on a finished run says it has nothing to do, and RUN_FILES names all a run writes."""

from __future__ import annotations

import argparse
import shutil

import pytest

from flowrl.config import config_to_dict
from flowrl.run.resume import RUN_FILES, plan_run

TINY = ("rollout.n=2", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4")


def _plan(cfg):
    return plan_run(cfg, config_to_dict(cfg))


def _train_cli(tiny_sd3_path, output_dir, *overrides) -> int:
    from flowrl.cli import train as cli

    overrides = [
        f"model.path={tiny_sd3_path}",
        f"trainer.output_dir={output_dir}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "trainer.val_every=0",
        *TINY,
        *overrides,
    ]
    return cli.run(argparse.Namespace(config=None, overrides=overrides))


@pytest.fixture(scope="module")
def trained_run(tiny_run_config, tmp_path_factory):
    """A finished 2-step run (validation, tensorboard, checkpoints), trained once for the module."""
    from flowrl.trainer.trainer import Trainer

    folder = tmp_path_factory.mktemp("finished") / "run"
    overrides = ("trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2", "logging.tensorboard=true")
    with Trainer(tiny_run_config(folder, *TINY, *overrides)) as trainer:
        trainer.fit()
    return folder


@pytest.fixture
def finished_run(trained_run, make_cfg):
    """A copy of the finished run in the folder `make_cfg()` trains in (each test may change its copy)."""
    folder = make_cfg().trainer.output_dir
    shutil.copytree(trained_run, folder)
    return folder


def test_run_files_name_everything_a_run_writes(finished_run):
    from pathlib import Path

    assert sorted(p.name for p in Path(finished_run).iterdir()) == sorted(RUN_FILES)


def test_new_run_in_a_used_folder_is_refused_naming_folder_and_choices(make_cfg, finished_run):
    with pytest.raises(ValueError) as caught:
        _plan(make_cfg(*TINY, "trainer.resume=never"))
    message = str(caught.value)
    assert "\n" not in message and finished_run in message
    for choice in ("trainer.resume=auto", "new trainer.output_dir", "trainer.overwrite=true"):
        assert choice in message, message


def test_auto_without_a_checkpoint_in_a_used_folder_is_refused(make_cfg, tmp_path):
    cfg = make_cfg(*TINY)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that crashed before its first checkpoint
    with pytest.raises(ValueError, match=r"holds another run's files \(metrics\.jsonl\) but no checkpoint"):
        _plan(cfg)


def test_overwrite_deletes_the_run_files_only(build_trainer, make_cfg, finished_run, capfd):
    from pathlib import Path

    out = Path(finished_run)
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    cfg = make_cfg(*TINY, "trainer.total_steps=1", "trainer.overwrite=true", "trainer.save_every=1")
    build_trainer(cfg).fit()
    assert "trainer.overwrite=true: deleted" in capfd.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and (out / "data").is_dir()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]  # the old step_000002 is gone
    assert not (out / "val").exists()  # this run validates nothing (val_every=0)


def test_overwrite_with_an_explicit_checkpoint_is_an_error(make_cfg, tmp_path):
    with pytest.raises(ValueError, match="trainer.overwrite=true starts a new run"):
        _plan(make_cfg(*TINY, "trainer.overwrite=true", f"trainer.resume={tmp_path}"))


def test_rerun_of_a_finished_run_has_nothing_to_do(tiny_sd3_path, finished_run, capsys, monkeypatch):
    from flowrl.engine.engine import DiffusionEngine

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run loaded its model")

    monkeypatch.setattr(DiffusionEngine, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))
    assert _train_cli(tiny_sd3_path, finished_run, "trainer.total_steps=2") == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "step 2" in out and "steps trained" not in out, out


def test_rerun_of_a_finished_run_without_checkpoints_has_nothing_to_do(tiny_sd3_path, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert _train_cli(tiny_sd3_path, out_dir, "trainer.total_steps=1", "trainer.save_every=0") == 0
    assert "steps trained: 1" in capsys.readouterr().out
    assert _train_cli(tiny_sd3_path, out_dir, "trainer.total_steps=1", "trainer.save_every=0") == 0
    assert "nothing to do" in capsys.readouterr().out
    # More steps cannot continue without a checkpoint: refused, exit 2 with one line.
    assert _train_cli(tiny_sd3_path, out_dir, "trainer.total_steps=2", "trainer.save_every=0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint that can be resumed" in err[0], err


def test_rerun_of_a_run_that_ended_past_its_last_checkpoint_has_nothing_to_do(tiny_sd3_path, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert _train_cli(tiny_sd3_path, out_dir, "trainer.total_steps=3", "trainer.save_every=2") == 0
    capsys.readouterr()
    assert _train_cli(tiny_sd3_path, out_dir, "trainer.total_steps=3", "trainer.save_every=2") == 0
    assert "nothing to do" in capsys.readouterr().out  # not a redo of step 3 from the step-2 checkpoint


def test_a_crash_before_the_first_checkpoint_is_restarted_by_the_same_command(
    build_trainer, make_cfg, tiny_sd3_path, monkeypatch, capsys
):
    """The same command again restarts a folder whose only files are an earlier start's of the
    same config, saying so; another config is still refused (issue 52)."""
    from pathlib import Path

    from flowrl.trainer.trainer import Trainer

    overrides = ("trainer.total_steps=1", "trainer.val_every=1", "trainer.save_every=1")
    cfg = make_cfg(*TINY, *overrides)
    out = Path(cfg.trainer.output_dir)

    def crash(self):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", crash)
        with pytest.raises(RuntimeError, match="out of memory"):
            build_trainer(cfg).fit()  # validated step 0, then crashed in step 1
    left = sorted(p.name for p in out.iterdir())
    assert "run_config.json" in left and "val" in left and "checkpoints" not in left
    with pytest.raises(ValueError, match="holds another run's files"):
        _plan(make_cfg(*TINY, *overrides, "trainer.lr=0.5"))  # another config: refused as before
    plan = _plan(make_cfg(*TINY, *overrides, "trainer.resume=never"))  # this invocation's keys aside
    assert sorted(plan.delete) == left and plan.checkpoint is None
    assert _train_cli(tiny_sd3_path, out, *overrides, "trainer.val_every=1") == 0
    assert "restarting: deleted" in capsys.readouterr().err
    assert (out / "checkpoints" / "step_000001").is_dir()
    (out / "checkpoints" / "step_000001" / "state.json").unlink()  # a checkpoint folder, even damaged:
    with pytest.raises(ValueError, match="holds another run's files"):  # never deleted unasked
        _plan(make_cfg(*TINY, *overrides, "trainer.total_steps=2"))  # (at 1 it is finished)


def test_a_folder_with_only_the_config_of_a_start_that_wrote_nothing_else_is_a_fresh_start(make_cfg):
    """A run that stopped before it wrote anything but run_config.json (a model that failed to load,
    a trainer built and closed) leaves nothing to protect: any config starts there."""
    from pathlib import Path

    from flowrl.run.resume import RUN_CONFIG, RunPlan

    cfg = make_cfg(*TINY)
    Path(cfg.trainer.output_dir).mkdir()  # as check_before_loading leaves it
    RunPlan().start(cfg.trainer.output_dir, config_to_dict(cfg))
    assert (Path(cfg.trainer.output_dir) / RUN_CONFIG).is_file()
    plan = _plan(make_cfg(*TINY, "trainer.lr=0.5"))  # another config
    assert plan.checkpoint is None and plan.delete == [] and plan.finished is None
