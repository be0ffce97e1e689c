"""Trained weights outside the trainer: final/ is a pipeline folder diffusers loads, and
`flowrl generate` with --lora / --checkpoint / --run (and --ema) reproduces the run's validation
images exactly (same seeds, same sampling path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from flowrl.cli import main

REPO = Path(__file__).resolve().parents[2]


def _generate(tmp_path: Path, name: str, *flags: str) -> np.ndarray:
    """Images (N, 3, H, W) uint8 that `flowrl generate ... --out tmp/name` wrote, in prompt order."""
    out = tmp_path / name
    assert main(["generate", *flags, "--out", str(out)]) == 0
    paths = sorted(out.glob("p*_s*.png"))
    return np.stack([np.asarray(Image.open(p)).transpose(2, 0, 1) for p in paths])


def _prompt_flags(run) -> list[str]:
    return [flag for prompt in run.val_prompts for flag in ("--prompt", prompt)]


def test_generate_lora_equals_the_runs_validation_images(tiny_lora_run, tmp_path):
    run = tiny_lora_run
    prompts = _prompt_flags(run)
    base = _generate(
        tmp_path, "base", "--model", str(run.model), "--config", str(REPO / "recipes" / "tiny_cpu.yaml"), *prompts
    )
    lora = _generate(tmp_path, "lora", "--model", str(run.model), "--lora", str(run.dir / "final" / "lora"), *prompts)
    assert np.array_equal(base, run.validation_images[0].numpy())  # step 0: before any update
    assert np.array_equal(lora, run.validation_images[2].numpy())
    assert not np.array_equal(lora, base)


def test_generate_checkpoint_and_run_reproduce_validation(tiny_lora_run, tmp_path):
    run = tiny_lora_run
    prompts = _prompt_flags(run)
    final_step = run.validation_images[2].numpy()
    checkpoint = _generate(tmp_path, "ckpt", "--checkpoint", str(run.dir / "checkpoints" / "step_000002"), *prompts)
    newest = _generate(tmp_path, "run", "--run", str(run.dir), *prompts)  # the model comes from the run's config
    assert np.array_equal(checkpoint, final_step) and np.array_equal(newest, final_step)
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["weights"]["label"] == "step_000002"  # final/ holds step 2 too: the checkpoint is used


def test_generate_ema_reads_ema_safetensors(tiny_lora_run, tmp_path, capsys):
    run = tiny_lora_run
    step = tmp_path / "step_000002"
    shutil.copytree(run.dir / "checkpoints" / "step_000002", step)
    prompts = _prompt_flags(run)
    assert main(["generate", "--checkpoint", str(step), "--ema", *prompts, "--out", str(tmp_path / "x")]) == 2
    assert "ema.safetensors" in capsys.readouterr().err
    # An EMA file whose LoRA update is zero samples the base model.
    weights = load_file(str(step / "trainable.safetensors"))
    save_file(
        {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in weights.items()}, str(step / "ema.safetensors")
    )
    ema = _generate(tmp_path, "ema", "--checkpoint", str(step), "--ema", *prompts)
    assert np.array_equal(ema, run.validation_images[0].numpy())


def test_final_is_a_pipeline_folder_that_diffusers_loads(tiny_lora_run):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.eval.weights import WeightLoader, lora_source
    from flowrl.models.registry import load_adapter

    final = tiny_lora_run.dir / "final"
    info = json.loads((final / "flowrl_run.json").read_text())
    assert info["step"] == 2 and info["trained"] == "lora"
    assert (final / "vae").is_symlink() and (final / "lora" / "pytorch_lora_weights.safetensors").is_file()
    trained = StableDiffusion3Pipeline.from_pretrained(str(final))
    base = StableDiffusion3Pipeline.from_pretrained(str(tiny_lora_run.model))
    # The fused transformer computes what the base plus the trained LoRA computes (flowrl's loader).
    adapter = load_adapter(tiny_lora_run.model)
    loader = WeightLoader(adapter)
    loader.load(lora_source(final / "lora"))
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=generator),
        "timestep": torch.tensor([300.0, 700.0]),
        "encoder_hidden_states": torch.randn(2, 333, 64, generator=generator),
        "pooled_projections": torch.randn(2, 64, generator=generator),
        "return_dict": False,
    }
    with torch.no_grad():
        fused, lora, plain = (m(**inputs)[0] for m in (trained.transformer, adapter.transformer, base.transformer))
    torch.testing.assert_close(fused, lora, atol=1e-5, rtol=1e-5)
    assert (fused - plain).abs().max() > 1e-4
    # And the pipeline's own output reflects the training.
    images = [
        np.asarray(
            p(
                "a cat",
                num_inference_steps=2,
                height=64,
                width=64,
                generator=torch.Generator().manual_seed(1),
                output_type="np",
            ).images
        )
        for p in (trained, base)
    ]
    assert not np.array_equal(*images)


def test_final_copies_components_where_symlinks_fail(tiny_sd3_path, tmp_path, monkeypatch):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.models.registry import load_adapter
    from flowrl.run.export import export_pipeline

    def no_symlinks(self, target, target_is_directory=False):
        raise OSError("symlinks not supported here")

    monkeypatch.setattr(Path, "symlink_to", no_symlinks)
    adapter = load_adapter(tiny_sd3_path)
    with torch.no_grad():
        adapter.transformer.proj_out.weight.add_(0.5)  # "trained" full weights
    final = export_pipeline(adapter, tmp_path / "final", step=1, config=None)
    assert (final / "vae").is_dir() and not (final / "vae").is_symlink()
    loaded = StableDiffusion3Pipeline.from_pretrained(str(final))
    torch.testing.assert_close(loaded.transformer.proj_out.weight, adapter.transformer.proj_out.weight)
    assert json.loads((final / "flowrl_run.json").read_text())["trained"] == "full"


def test_weights_that_do_not_fit_the_model_name_the_fix(tiny_lora_run, tiny_sd3_path, tmp_path, capsys):
    step = tmp_path / "step_000001"
    shutil.copytree(tiny_lora_run.dir / "checkpoints" / "step_000001", step)
    weights = load_file(str(step / "trainable.safetensors"))
    weights["transformer_blocks.9.attn.to_q.lora_A.default.weight"] = torch.zeros(8, 32)
    save_file(weights, str(step / "trainable.safetensors"))
    flags = [
        "--model",
        str(tiny_sd3_path),
        "--checkpoint",
        str(step),
        "--prompt",
        "a cat",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(["generate", *flags]) == 2
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if line.startswith("flowrl generate: error:")]
    assert "Traceback" not in err and "does not match" in error and "--model" in error


def test_generate_and_eval_read_a_sharded_full_fine_tuning_checkpoint(tiny_sd3_path, tmp_path):
    """A multi-rank full fine-tune's checkpoint holds sharded/ (no trainable.safetensors): it is
    gathered on load, and samples as the one-process layout of the same weights does."""
    from types import SimpleNamespace

    from flowrl.config import config_to_dict
    from flowrl.distributed.world import World
    from flowrl.models.lora import apply_trainable
    from flowrl.models.registry import load_adapter
    from flowrl.run.checkpoint import save_checkpoint
    from flowrl.run.config import load_train_config
    from flowrl.trainer.ema import ParameterEMA

    config = config_to_dict(load_train_config(None, [f"model.path={tiny_sd3_path}"]))
    transformer = load_adapter(tiny_sd3_path, device="cpu", dtype=torch.float32).transformer
    apply_trainable(transformer, SimpleNamespace(enabled=False))  # full fine-tuning: every parameter
    with torch.no_grad():
        for param in transformer.parameters():
            param.mul_(1.05)  # trained weights: other than the base's
    params = dict(transformer.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
    ema = ParameterEMA(params, decay=0.9, update_every=1)
    adapter = SimpleNamespace(transformer=transformer)
    sharded = SimpleNamespace(world=World.single(), is_sharded=True)
    saved = {}
    for name, parallel in (("sharded", sharded), ("whole", None)):
        saved[name] = save_checkpoint(tmp_path / name, 3, adapter, optimizer, list(params), {}, config, ema, parallel)
    assert (saved["sharded"] / "sharded").is_dir() and not (saved["sharded"] / "trainable.safetensors").exists()
    prompts = ["--prompt", "a red apple", "--prompt", "a cat"]
    images = {
        name: _generate(tmp_path, f"gen-{name}", "--checkpoint", str(path), *prompts) for name, path in saved.items()
    }
    base = _generate(
        tmp_path,
        "gen-base",
        "--model",
        str(tiny_sd3_path),
        "--config",
        str(REPO / "recipes" / "tiny_cpu.yaml"),
        *prompts,
    )
    assert np.array_equal(images["sharded"], images["whole"]) and not np.array_equal(images["sharded"], base)
    ema_images = _generate(tmp_path, "gen-ema", "--checkpoint", str(saved["sharded"]), "--ema", *prompts)
    assert ema_images.shape == images["sharded"].shape
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("a red apple\n")
    argv = ["eval", "--run", str(tmp_path / "sharded"), "--prompts", str(prompt_file), "--reward", "image_flatness"]
    assert main([*argv, "--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    assert "step_000003" in json.dumps(report)


def test_generate_run_of_the_embedded_model_uses_the_runs_model_or_says_where_it_builds(
    tiny_sd3_path, tmp_path, monkeypatch, capsys
):
    """A run of the embedded tiny model (model.path unset) started in another folder: generate --run
    samples with the model its final/ names, and builds none in the current folder; without one,
    it builds the tiny model and says where (issue 52)."""
    from flowrl.run.config import load_train_config
    from flowrl.trainer.trainer import Trainer

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache_a"))
    shutil.copytree(tiny_sd3_path, tmp_path / "cache_a" / "tiny-sd3")  # what `flowrl train` builds there
    overrides = ["trainer.total_steps=1", "trainer.save_every=1", "trainer.val_every=0", "rollout.n=2"]
    overrides += ["trainer.prompts_per_step=1", "logging.tensorboard=false", "logging.progress_bar=false"]
    cfg = load_train_config(None, [f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    assert cfg.model.path is None
    with Trainer(cfg) as trainer:
        trainer.fit()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache_b"))
    first = _generate(tmp_path, "from_final", "--run", str(tmp_path / "run"), "--prompt", "a cat")
    assert not (tmp_path / "cache_b").exists() and not (elsewhere / "outputs").exists()
    assert "built it in" not in capsys.readouterr().err
    shutil.rmtree(tmp_path / "run" / "final")  # a run stopped before its end: checkpoints only
    again = _generate(tmp_path, "from_checkpoint", "--run", str(tmp_path / "run"), "--prompt", "a cat")
    err = capsys.readouterr().err
    assert f"built it in {tmp_path / 'cache_b' / 'tiny-sd3'}" in err and "embedded tiny SD3 model" in err
    assert np.array_equal(first, again)  # the same model, the same step's weights
