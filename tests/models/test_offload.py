"""model.offload_text_encoders: the text encoders' weights leave the device and stream to it only
while prompts are encoded; the encodings are unchanged; a CPU run and a random-weight model, which
have no GPU memory or no encoder to free, are refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from flowrl.models.offload import offload_text_encoders
from flowrl.models.registry import load_adapter

PROMPTS = ["a red circle", "two blue squares on the left"]


def _same_encodings(a, b) -> bool:
    return all(
        torch.equal(x.embeds, y.embeds) and (x.pooled is None or torch.equal(x.pooled, y.pooled)) for x, y in zip(a, b)
    )


def test_offloaded_encoders_hold_no_weights_and_encode_the_same(tiny_sd3_path):
    plain, offloaded = load_adapter(tiny_sd3_path), load_adapter(tiny_sd3_path)
    assert offload_text_encoders(offloaded) == ["text_encoder", "text_encoder_2", "text_encoder_3"]
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        assert {p.device.type for p in getattr(offloaded.pipeline, name).parameters()} == {"meta"}
    assert _same_encodings(plain.encode_prompts(PROMPTS), offloaded.encode_prompts(PROMPTS))
    assert {p.device.type for p in offloaded.transformer.parameters()} == {"cpu"}  # the rest stays


def test_offload_is_refused_on_a_cpu_and_for_random_weights(tiny_sd3_path, monkeypatch, capsys):
    from flowrl.cli import main

    with pytest.raises(ValueError, match=r"model.offload_text_encoders=true .* model runs on the CPU"):
        load_adapter(tiny_sd3_path, device="cpu", offload_text_encoders=True)
    with pytest.raises(ValueError, match=r"model.path='random:tiny-sd3' has no text encoders"):
        load_adapter("random:tiny-sd3", device="cuda", offload_text_encoders=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["train", f"model.path={tiny_sd3_path}", "model.offload_text_encoders=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.offload_text_encoders=true" in err and "set model.offload_text_encoders=false" in err


@pytest.mark.gpu
def test_on_a_gpu_the_encoders_memory_is_freed_and_the_encodings_kept(tiny_sd3_path):
    def loaded(**options):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        adapter = load_adapter(tiny_sd3_path, device="cuda", **options)
        return adapter, torch.cuda.memory_allocated() - before, before

    plain, held_plain, _ = loaded()
    expected = plain.encode_prompts(PROMPTS)
    encoder_bytes = sum(
        p.numel() * p.element_size()
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
        for p in getattr(plain.pipeline, name).parameters()
    )
    del plain
    offloaded, held, before = loaded(offload_text_encoders=True)
    assert held_plain - held >= 0.9 * encoder_bytes, (held_plain, held, encoder_bytes)
    encodings = offloaded.encode_prompts(PROMPTS)
    assert all(torch.allclose(x.embeds, y.embeds) for x, y in zip(expected, encodings))
    assert torch.cuda.memory_allocated() - before < held + encoder_bytes / 2  # streamed in, then gone


def test_an_engine_over_offloaded_encoders_samples_what_it_samples_without(tiny_sd3_path):
    from flowrl.engine import DiffusionEngine, SamplingParams

    params = SamplingParams(height=64, width=64, num_inference_steps=3, guidance_scale=2.0, seed=3)
    images = []
    for offload in (False, True):
        adapter = load_adapter(tiny_sd3_path)
        if offload:
            offload_text_encoders(adapter)
        engine = DiffusionEngine(adapter)
        try:
            images.append([engine.generate(prompt, params).image for prompt in PROMPTS])
        finally:
            engine.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(*images))
