"""Tiny offline checkpoints: determinism, loadability by diffusers, tokenizer shape, CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.models.debug.tiny import build_tiny_checkpoint, parameter_counts
from flowrl.models.debug.tiny_tokenizers import (
    COMMON_WORDS,
    QWEN_IMAGE_PREFIX_TOKENS,
    QWEN_IMAGE_TEMPLATE,
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
)


def _file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(file.relative_to(folder)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


@pytest.mark.parametrize("kind", ["sd3", "qwen_image", "flux", "z_image"])
def test_same_seed_builds_are_byte_identical_and_other_seeds_differ(kind, tmp_path):
    first = _file_hashes(build_tiny_checkpoint(kind, tmp_path / "a", seed=3))
    second = _file_hashes(build_tiny_checkpoint(kind, tmp_path / "b", seed=3))
    other = _file_hashes(build_tiny_checkpoint(kind, tmp_path / "c", seed=4))
    assert first.pop(".flowrl-tiny") == second.pop(".flowrl-tiny") != other.pop(".flowrl-tiny")  # records the seed
    assert any(name.endswith(".safetensors") for name in first)
    assert first == second
    changed = {name for name in first if first[name] != other[name]}
    assert changed and all(name.endswith(".safetensors") for name in changed)


def test_existing_checkpoint_of_same_kind_and_seed_is_reused(tmp_path):
    path = build_tiny_checkpoint("sd3", tmp_path / "tiny", seed=0)
    weights = path / "transformer" / "diffusion_pytorch_model.safetensors"
    before = weights.stat().st_mtime_ns, weights.read_bytes()
    assert build_tiny_checkpoint("sd3", path, seed=0) == path
    assert weights.stat().st_mtime_ns == before[0]
    # Another seed or kind in flowrl's own folder is a rebuild, not a silent reuse.
    assert build_tiny_checkpoint("sd3", path, seed=99) == path
    assert weights.read_bytes() != before[1]
    rebuilt = build_tiny_checkpoint("qwen_image", path, seed=0)
    assert json.loads((rebuilt / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"


def test_unknown_kind_is_rejected_with_choices(tmp_path):
    with pytest.raises(ValueError, match=r"kind='sdxl'.*sd3.*qwen_image.*flux"):
        build_tiny_checkpoint("sdxl", tmp_path)
    assert not any(tmp_path.iterdir())


def test_sd3_folder_loads_and_generates(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        assert len(getattr(pipeline, name)) > 100, name
    images = pipeline(
        "a red sign that says hello",
        height=64,
        width=64,
        num_inference_steps=2,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


def test_qwen_folder_loads_and_generates(tiny_qwen_path):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(tiny_qwen_path)
    assert len(pipeline.tokenizer) > 100
    images = pipeline(
        "a blue poster with the word open",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


def test_qwen_chat_prefix_is_exactly_the_dropped_tokens(tiny_qwen_path):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(tiny_qwen_path)
    # Our copy of the template must match diffusers', and its system part must be exactly as long
    # as the number of hidden states the pipeline drops.
    assert pipeline.prompt_template_encode == QWEN_IMAGE_TEMPLATE
    assert pipeline.prompt_template_encode_start_idx == QWEN_IMAGE_PREFIX_TOKENS == 34
    prefix = pipeline.prompt_template_encode.split("{}")[0]
    assert len(pipeline.tokenizer(prefix).input_ids) == 34
    # The prompt's own tokens follow the prefix unchanged.
    prompt = "a cat with a sign"
    full = pipeline.tokenizer(pipeline.prompt_template_encode.format(prompt)).input_ids
    prompt_ids = pipeline.tokenizer(prompt).input_ids
    assert full[34 : 34 + len(prompt_ids)] == prompt_ids


def test_vocab_words_are_single_tokens_and_anything_tokenizes():
    clip, qwen, t5 = build_clip_tokenizer(), build_qwen2_tokenizer(), build_t5_tokenizer()
    for word in COMMON_WORDS:
        assert len(clip(word, add_special_tokens=False).input_ids) == 1, word
        assert len(qwen(" " + word).input_ids) == 1, word
        assert len(t5(word, add_special_tokens=False).input_ids) == 1, word
    odd = "Zebra-crossing 42 ümlaut 東京 \t\n!!"
    for tokenizer in (clip, qwen, t5):
        ids = tokenizer(odd).input_ids
        assert len(ids) > 5 and all(0 <= i < len(tokenizer) for i in ids)
    # Padding ids the text encoders are configured with.
    assert (clip.bos_token_id, clip.eos_token_id, clip.pad_token_id) == (0, 1, 1)
    assert (t5.pad_token_id, t5.eos_token_id) == (0, 1)
    assert qwen.pad_token_id == qwen.convert_tokens_to_ids("<|endoftext|>")
    assert qwen.eos_token_id == qwen.convert_tokens_to_ids("<|im_end|>") != qwen.pad_token_id


def test_parameter_counts_cover_every_model_component(tiny_sd3_path):
    counts = parameter_counts(tiny_sd3_path)
    assert set(counts) == {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"}
    assert all(count > 1000 for count in counts.values())


def test_make_tiny_cli_runs_in_process(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "cli_sd3"
    assert main(["make-tiny", "--kind", "sd3", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "transformer" in printed
    assert (out / "model_index.json").is_file()
