"""Bad input fails with a ValueError naming the field, before any model is loaded."""

import pytest

from flowrl.trainer.trainer import Trainer


def test_missing_model_path(make_cfg, tmp_path, no_model_loading):
    cfg = make_cfg(f"model.path={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="model.path=.*does not exist"):
        Trainer(cfg)


def test_empty_dataset(make_cfg, tmp_path, no_model_loading):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="data.train_path=.*holds no prompts"):
        Trainer(make_cfg(f"data.train_path={empty}"))


def test_missing_dataset_file(make_cfg, tmp_path, no_model_loading):
    with pytest.raises(ValueError, match="data.train_path=.*does not exist"):
        Trainer(make_cfg(f"data.train_path={tmp_path / 'missing.jsonl'}"))


def test_group_of_one(make_cfg, no_model_loading):
    with pytest.raises(ValueError, match="rollout.n"):
        make_cfg("rollout.n=1")  # the config check
    cfg = make_cfg()
    cfg.rollout.n = 1  # a hand-edited config object is checked again by the trainer
    with pytest.raises(ValueError, match="rollout.n"):
        Trainer(cfg)


def test_unknown_reward(make_cfg, no_model_loading):
    with pytest.raises(ValueError, match="unknown reward name 'no_such_reward'"):
        Trainer(make_cfg("reward.name=no_such_reward"))


def test_kl_without_lora(make_cfg, no_model_loading):
    with pytest.raises(ValueError, match="algorithm.kl_beta"):
        Trainer(make_cfg("algorithm.kl_beta=0.1", "trainer.lora.enabled=false"))


def test_cli_reports_bad_input_with_exit_code_2(tiny_sd3_path, tmp_path, capsys, no_model_loading):
    from flowrl.cli import main

    code = main(["train", f"model.path={tmp_path / 'nowhere'}", f"trainer.output_dir={tmp_path / 'out'}"])
    assert code == 2
    assert "model.path" in capsys.readouterr().err


def test_a_trainer_that_fails_to_build_leaves_no_reward_workers(make_cfg, monkeypatch):
    """The reward scorer's threads start last in Trainer.__init__, so a failure before it
    (here: the metrics logger) leaves no worker behind that nothing could close."""
    import threading

    import flowrl.trainer.trainer as trainer_module

    def broken_logger(*args, **kwargs):
        raise OSError("metrics folder not writable")

    def reward_workers():
        return {t for t in threading.enumerate() if t.name.startswith("reward-worker-")}

    before = reward_workers()
    monkeypatch.setattr(trainer_module, "MetricsLogger", broken_logger)
    with pytest.raises(OSError, match="not writable"):
        Trainer(make_cfg())
    assert reward_workers() == before
