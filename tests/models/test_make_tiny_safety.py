"""make-tiny never destroys what it did not write: foreign folders are refused (exit 2, one line),
--overwrite replaces same-named files only, and its own earlier builds are replaced cleanly."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.models.debug.tiny import build_tiny_checkpoint, parameter_counts
from flowrl.output_paths import OutputExistsError


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _fake_sharded_checkpoint(folder: Path, class_name: str) -> Path:
    """A folder shaped like a real sharded diffusers checkpoint (weights replaced by stand-in bytes)."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(f'{{"_class_name": "{class_name}", "transformer": ["diffusers", "X"]}}')
    (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {}}')
    for shard in range(1, 4):
        (folder / "transformer" / f"diffusion_pytorch_model-0000{shard}-of-00003.safetensors").write_bytes(
            bytes([shard]) * 4096
        )
    return folder


@pytest.mark.parametrize("kind, class_name", [("qwen_image", "QwenImagePipeline"), ("sd3", "StableDiffusion3Pipeline")])
def test_make_tiny_refuses_a_real_checkpoint_and_leaves_it_intact(kind, class_name, tmp_path, capsys):
    folder = _fake_sharded_checkpoint(tmp_path / "Qwen-Image", class_name)
    before = _snapshot(folder)
    assert main(["make-tiny", "--kind", kind, str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder) in err[0] and "--overwrite" in err[0]
    assert _snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Qwen-Image"]  # no staging folder left behind


def test_overwrite_replaces_same_named_files_only(tmp_path, capsys):
    folder = _fake_sharded_checkpoint(tmp_path / "real", "QwenImagePipeline")
    before = _snapshot(folder)
    assert main(["make-tiny", "--kind", "sd3", "--overwrite", str(folder)]) == 0
    after = _snapshot(folder)
    kept = {name: digest for name, digest in before.items() if name != "model_index.json"}
    assert all(after[name] == digest for name, digest in kept.items())  # nothing foreign deleted or changed
    assert "StableDiffusion3Pipeline" in (folder / "model_index.json").read_text()
    # The printed counts are those of the files make-tiny wrote, not of the foreign shards.
    assert parameter_counts(folder) == parameter_counts(build_tiny_checkpoint("sd3", tmp_path / "fresh"))


def test_own_folder_is_rebuilt_without_touching_added_files(tmp_path):
    folder = build_tiny_checkpoint("qwen_image", tmp_path / "tiny")
    (folder / "notes.txt").write_text("mine")
    build_tiny_checkpoint("sd3", folder)
    assert (folder / "notes.txt").read_text() == "mine"
    assert (folder / "text_encoder_3").is_dir()  # sd3's own layout
    fresh = _snapshot(build_tiny_checkpoint("sd3", tmp_path / "fresh"))
    assert _snapshot(folder) == {**fresh, "notes.txt": _snapshot(folder)["notes.txt"]}  # no qwen leftovers


def test_unmarked_tiny_build_is_adopted_but_an_edited_one_is_not(tmp_path):
    legacy = build_tiny_checkpoint("sd3", tmp_path / "legacy")
    (legacy / ".flowrl-tiny").unlink()  # as written before markers existed
    assert build_tiny_checkpoint("sd3", legacy) == legacy
    shutil.copytree(legacy, tmp_path / "edited")
    (tmp_path / "edited" / ".flowrl-tiny").unlink()
    (tmp_path / "edited" / "vae" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        build_tiny_checkpoint("sd3", tmp_path / "edited")


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        build_tiny_checkpoint("sd3", target, overwrite=True)
    assert target.read_text() == "x"
