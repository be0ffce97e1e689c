"""Mistakes that once surfaced only after the model had loaded now fail before it, as one-line
ValueErrors naming key, value and fix; `flowrl train` exits 2 on each."""

from __future__ import annotations

import pytest

from flowrl.trainer.trainer import Trainer


@pytest.fixture
def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _blocked_dir(tmp_path) -> str:
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "out")  # a folder under a regular file cannot be made


CASES = [
    (["rollout.sampling.height=100000"], "rollout.sampling.height=100000"),
    (["rollout.sampling.num_inference_steps=100000"], "rollout.sampling.num_inference_steps"),
    (["model.device=cuda"], "model.device='cuda'"),
    (["model.device=cuda:1"], "model.device='cuda:1'"),
    (["rollout.sampling.num_inference_steps=1"], "rollout.sampling.num_inference_steps=1"),
    (["rollout.sampling.guidance_scale=4.5", "engine.max_batch_rows=1"], "engine.max_batch_rows=1"),
    (["trainer.lr=.nan"], "trainer.lr=nan"),
    (["model.family=qwen_image", "model.path=null"], "model.family='qwen_image'"),
]


@pytest.mark.parametrize("overrides, message", CASES)
def test_fails_before_loading(make_cfg, no_model_loading, no_gpu, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        Trainer(make_cfg(*overrides))
    assert "\n" not in str(error.value)


def test_unwritable_output_dir(make_cfg, no_model_loading, tmp_path):
    cfg = make_cfg()
    cfg.trainer.output_dir = _blocked_dir(tmp_path)
    with pytest.raises(ValueError, match=r"trainer.output_dir=.*is not writable"):
        Trainer(cfg)


@pytest.mark.parametrize("overrides, message", CASES[:3])
def test_cli_exits_2_with_one_line(tiny_sd3_path, tmp_path, capsys, no_model_loading, no_gpu, overrides, message):
    from flowrl.cli import main

    args = ["train", f"model.path={tiny_sd3_path}", f"trainer.output_dir={tmp_path / 'out'}", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert main(["train", f"model.path={tiny_sd3_path}", f"trainer.output_dir={_blocked_dir(tmp_path)}"]) == 2
    assert "trainer.output_dir" in capsys.readouterr().err
