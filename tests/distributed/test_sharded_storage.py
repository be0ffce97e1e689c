"""Sharded checkpoints (`sharded/` of a checkpoint) hold safetensors and JSON only, and nothing in
them is unpickled on load: a crafted pickle (torch DCP's `.metadata`, which torch's own reader
unpickles) is refused before anything reads it, even with a recomputed manifest, and the code it
carries never runs. One process, no process group (the two-rank layout: test_torchrun.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.distributed import sharded_checkpoint
from flowrl.distributed.world import World
from flowrl.run import checkpoint
from flowrl.trainer.ema import ParameterEMA


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _save(folder: Path, seed: int = 0):
    """A checkpoint written as sharded full fine-tuning writes it (here by one process)."""
    model, optimizer = _model_and_optimizer(seed)
    params = dict(model.named_parameters())
    ema = ParameterEMA(params, decay=0.9, update_every=1)
    ema.step(1)
    parallel = SimpleNamespace(world=World.single(), is_sharded=True)
    path = checkpoint.save_checkpoint(
        folder, 1, SimpleNamespace(transformer=model), optimizer, list(params), {}, {}, ema, parallel
    )
    return path, model, optimizer, ema


# A pickle (protocol 0, written out by hand) that creates the file MARKER when unpickled.
def _crafted_pickle(marker: Path) -> bytes:
    return f"cbuiltins\nexec\n(Vopen({str(marker)!r}, 'w').close()\ntR.".encode()


def test_sharded_checkpoint_holds_no_pickle_and_loads_exactly(tmp_path):
    path, model, optimizer, ema = _save(tmp_path)
    files = sorted(p.name for p in (path / "sharded").iterdir())
    assert files == ["index.json", "optimizer.json", "rank0.safetensors"]
    for file in (path / "sharded").iterdir():
        assert not file.read_bytes().startswith(b"\x80") and b"PK\x03\x04" not in file.read_bytes()[:4]
    assert checkpoint.verify_checkpoint(path)

    fresh, fresh_optimizer = _model_and_optimizer(seed=1)  # other weights and optimizer state
    fresh_params = dict(fresh.named_parameters())
    fresh_ema = ParameterEMA(fresh_params, decay=0.9, update_every=1)
    state = checkpoint.load_checkpoint(path, fresh, fresh_optimizer, list(fresh_params), ema=fresh_ema)
    assert state["step"] == 1 and state["ema_restored"]
    for (name, saved), loaded in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(saved, loaded), name
    for saved, loaded in zip(optimizer.state.values(), fresh_optimizer.state.values()):
        assert all(torch.equal(saved[key], loaded[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    assert tuple(fresh_optimizer.param_groups[0]["betas"]) == optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert all(torch.equal(ema.averages[n], fresh_ema.averages[n]) for n in ema.averages)
    # Whole tensors without a process group (eval, generate, serve of a sharded run).
    whole = sharded_checkpoint.read_full_tensors(path, "model")
    assert set(whole) == set(dict(model.named_parameters()))
    assert all(torch.equal(whole[n], p.detach()) for n, p in model.named_parameters())


@pytest.mark.parametrize("keep_index", [True, False])
def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path, capsys, keep_index):
    """torch's DCP reader would unpickle sharded/.metadata; with a recomputed manifest the folder
    verifies by its checksums, yet it is refused and the marker its pickle would write never appears."""
    path, model, optimizer, _ = _save(tmp_path / "run")
    marker = tmp_path / "marker"
    (path / "sharded" / ".metadata").write_bytes(_crafted_pickle(marker))
    if not keep_index:  # the layout of torch's own writer: no index.json, the pickle in its place
        (path / "sharded" / "index.json").unlink()
    (path / "manifest.json").unlink()
    checkpoint.write_manifest(path)
    with pytest.raises(checkpoint.CheckpointError, match=r"sharded/.*\.metadata"):
        checkpoint.verify_checkpoint(path)
    with pytest.raises(ValueError, match=r"\.metadata"):
        checkpoint.load_checkpoint(path, model, optimizer, [n for n, _ in model.named_parameters()], verify=False)
    assert checkpoint.find_resume_checkpoint("auto", tmp_path / "run") is None  # skipped, saying why
    assert ".metadata" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\.metadata"):
        sharded_checkpoint.read_full_tensors(path, "model")
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage, fault",
    [
        (lambda index: index["tensors"]["model.0.weight"]["chunks"][0].update(file="../../x.safetensors"), "chunk"),
        (lambda index: index["tensors"]["model.0.weight"].update(dtype="Tensor"), "dtype"),
        (lambda index: index["tensors"]["model.0.weight"]["chunks"][0].update(offsets=[9, 0]), "chunk"),
        (lambda index: index.update(format="torch"), "not a flowrl index"),
    ],
)
def test_a_damaged_index_is_refused_naming_the_tensor(tmp_path, damage, fault):
    path, *_ = _save(tmp_path)
    index = json.loads((path / "sharded" / "index.json").read_text())
    damage(index)
    (path / "sharded" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=fault):
        sharded_checkpoint.check_sharded_folder(path)
