"""Checkpoint manifests: every corruption (zeroed bytes, truncated, missing file, torn JSON) is
caught with a message naming the file; `resume=auto` falls back to the newest checkpoint that
verifies and ends where an uninterrupted run from that checkpoint ends; an explicit bad
`trainer.resume=PATH` is an error; a checkpoint without a manifest loads with a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.config import config_to_dict
from flowrl.run.checkpoint import MANIFEST, CheckpointError, checkpoint_dir, verify_checkpoint
from flowrl.run.resume import plan_run
from flowrl.trainer.trainer import Trainer

SMALL = (
    "rollout.n=2",
    "trainer.prompts_per_step=2",
    "trainer.micro_batch_size=4",
    "trainer.lora.enabled=true",
    "trainer.lora.rank=4",
    "trainer.lr=0.01",
    "rollout.sampling.sde_window_size=2",
)


@pytest.fixture(scope="module")
def trained_run(tiny_run_config, tmp_path_factory):
    """A 3-step run with a checkpoint after every step: (config builder, output folder)."""
    root = tmp_path_factory.mktemp("integrity")

    def build(*overrides, output="run"):
        return tiny_run_config(root / output, "trainer.save_every=1", *SMALL, *overrides)

    with Trainer(build("trainer.total_steps=3")) as trainer:
        trainer.fit()
    return build, root / "run"


def _copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _zero_4k(path: Path) -> None:
    size = path.stat().st_size
    assert size > 8192, size
    with path.open("r+b") as handle:
        handle.seek(size // 2)
        handle.write(bytes(4096))


def _truncate(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


CORRUPTIONS = {
    "zeroed 4 KiB": ("optimizer.safetensors", _zero_4k, "checksum mismatch"),
    "truncated": ("trainable.safetensors", _truncate, "size mismatch"),
    "missing file": ("rng.safetensors", Path.unlink, "missing"),
    "missing lora file": ("lora/pytorch_lora_weights.safetensors", Path.unlink, "missing"),
    "torn state.json": ("state.json", _truncate, "size mismatch"),
    "torn manifest": (MANIFEST, _truncate, "not valid JSON"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_is_detected_naming_the_file(trained_run, tmp_path, kind):
    name, damage, fault = CORRUPTIONS[kind]
    _, out = trained_run
    folder = _copy_run(checkpoint_dir(out, 3), tmp_path / "step_000003")
    assert verify_checkpoint(folder) is True
    damage(folder / name)
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(folder)
    message = str(caught.value)
    assert name in message and fault in message and str(folder) in message, message


def test_torn_state_json_without_a_manifest_names_the_file(trained_run, tmp_path):
    _, out = trained_run
    folder = _copy_run(checkpoint_dir(out, 3), tmp_path / "step_000003")
    (folder / MANIFEST).unlink()
    assert verify_checkpoint(folder) is False  # loadable, not verifiable
    _truncate(folder / "state.json")
    with pytest.raises(CheckpointError, match=r"state\.json is not valid JSON"):
        verify_checkpoint(folder)


def test_manifest_covers_every_file_of_the_checkpoint(trained_run):
    _, out = trained_run
    folder = checkpoint_dir(out, 1)
    listed = set(json.loads((folder / MANIFEST).read_text())["files"])
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    assert listed == on_disk and "state.json" in listed and "lora/pytorch_lora_weights.safetensors" in listed


def test_explicit_resume_of_a_damaged_checkpoint_is_an_error(trained_run, tmp_path):
    build, out = trained_run
    run = _copy_run(out, tmp_path / "run")
    _zero_4k(checkpoint_dir(run, 3) / "optimizer.safetensors")
    cfg = build(f"trainer.resume={checkpoint_dir(run, 3)}", "trainer.total_steps=4", output=str(run))
    with pytest.raises(ValueError, match=r"trainer\.resume=.*optimizer\.safetensors.*checksum mismatch"):
        plan_run(cfg, config_to_dict(cfg))


def test_auto_resume_skips_damaged_checkpoints_and_matches_a_run_from_the_one_it_took(
    build_trainer, trained_run, tmp_path, capfd
):
    build, out = trained_run
    # Reference: the same run with only checkpoints 1 and 2, resumed to step 5.
    reference = _copy_run(out, tmp_path / "reference")
    shutil.rmtree(checkpoint_dir(reference, 3))
    build_trainer(build("trainer.total_steps=5", "trainer.resume=auto", output=str(reference))).fit()
    capfd.readouterr()

    damaged = _copy_run(out, tmp_path / "damaged")
    _zero_4k(checkpoint_dir(damaged, 3) / "optimizer.safetensors")
    trainer = build_trainer(build("trainer.total_steps=5", "trainer.resume=auto", output=str(damaged)))
    skipped = [line for line in capfd.readouterr().err.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and "step_000003" in skipped[0] and "optimizer.safetensors" in skipped[0], skipped
    assert trainer.step == 2
    trainer.fit()

    want, got = (load_file(str(checkpoint_dir(d, 5) / "trainable.safetensors")) for d in (reference, damaged))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_checkpoint_without_manifest_loads_with_a_warning(build_trainer, trained_run, tmp_path, capfd):
    build, out = trained_run
    run = _copy_run(out, tmp_path / "old")
    (checkpoint_dir(run, 3) / MANIFEST).unlink()
    trainer = build_trainer(build("trainer.total_steps=4", "trainer.resume=auto", output=str(run)))
    assert trainer.step == 3
    err = capfd.readouterr().err
    assert "cannot be verified" in err and "step_000003" in err
