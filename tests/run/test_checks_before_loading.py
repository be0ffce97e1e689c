"""Mistakes that once surfaced only after the model had loaded now fail before it, as one-line
ValueErrors naming key, value and fix; `flowrl train` exits 2 on each."""

from __future__ import annotations

from types import SimpleNamespace

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


@pytest.mark.parametrize("prompts", [None, "prompts.txt", "prompts.jsonl"])
def test_ocr_reward_on_rows_without_ground_truth_fails_before_loading(make_cfg, no_model_loading, tmp_path, prompts):
    """The OCR reward would otherwise score every image against the text "None" (issue 52)."""
    overrides = ["reward.name=ocr"]
    if prompts is not None:
        path = tmp_path / prompts
        rows = ['{"prompt": "a sign", "ground_truth": "OPEN"}', '{"prompt": "a cafe"}']
        path.write_text("\n".join(rows if prompts.endswith(".jsonl") else ["a sign", "a cafe"]) + "\n")
        overrides.append(f"data.train_path={path}")
    with pytest.raises(ValueError) as error:
        Trainer(make_cfg(*overrides))
    message = str(error.value)
    where = "the built-in prompts" if prompts is None else f"data.train_path={str(tmp_path / prompts)!r}"
    row = 1 if prompts == "prompts.jsonl" else 0
    assert message.startswith(f"{where}") and f"row {row}: reward 'ocr' cannot score it" in message
    assert "'ground_truth'" in message and "choose another reward" in message and "\n" not in message


def test_rows_the_reward_can_score_pass_and_routed_or_optional_rewards_check_their_own_rows(tmp_path):
    from flowrl.rewards import build_reward_from_config
    from flowrl.rewards.base import check_rows

    ocr_rows = [{"raw_prompt": "a sign", "ground_truth": "OPEN", "data_source": "ocr"}]
    plain_rows = [{"raw_prompt": "a cat", "ground_truth": None, "data_source": "default"}]
    ocr = build_reward_from_config(SimpleNamespace(name="ocr", options={}, components=[], route_by_data_source={}))
    check_rows(ocr, ocr_rows, "f")  # no error
    routed = build_reward_from_config(
        SimpleNamespace(name="image_flatness", options={}, components=[], route_by_data_source={"ocr": "ocr"})
    )
    check_rows(routed, ocr_rows + plain_rows, "f")  # the plain rows go to image_flatness
    with pytest.raises(ValueError, match=r"f row 1: .*data_source='ocr' goes to 'ocr'"):
        check_rows(routed, ocr_rows + [{**plain_rows[0], "data_source": "ocr"}], "f")
    optional = [{"name": "ocr", "optional": True}, {"name": "image_flatness"}]
    required = [{"name": "ocr"}, {"name": "image_flatness"}]
    multi = SimpleNamespace(name=None, options={}, route_by_data_source={})
    check_rows(build_reward_from_config(SimpleNamespace(**vars(multi), components=optional)), plain_rows, "f")
    with pytest.raises(ValueError, match="f row 0: reward 'multi' cannot score it: component 'ocr'"):
        check_rows(build_reward_from_config(SimpleNamespace(**vars(multi), components=required)), plain_rows, "f")


def test_more_prompts_per_step_than_the_dataset_holds_is_remarked(build_trainer, make_cfg, tmp_path, capsys):
    prompts = tmp_path / "two.txt"
    prompts.write_text("a red apple\na blue car\n")
    build_trainer(make_cfg("trainer.prompts_per_step=3", "rollout.n=2", f"data.train_path={prompts}"))
    err = capsys.readouterr().err
    assert f"note: trainer.prompts_per_step=3 is more than the 2 prompts of data.train_path={str(prompts)!r}" in err
    assert "at most 2" in err
    build_trainer(make_cfg("trainer.prompts_per_step=2", "rollout.n=2", f"data.train_path={prompts}", output="other"))
    assert "prompts_per_step" not in capsys.readouterr().err
