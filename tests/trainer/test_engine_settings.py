"""Engine and model settings of the config reach the engine and its adapter (none is accepted and ignored)."""

import flowrl.accel


def test_engine_compile_compiles_the_trained_modules(build_trainer, make_cfg, monkeypatch):
    calls = []

    def fake_compile(adapter, backend="inductor", **switches):
        # Called after LoRA injection: the blocks hold the trained LoRA layers.
        calls.append((any("lora_A" in name for name, _ in adapter.transformer.named_parameters()), backend))
        return ["transformer.transformer_blocks.0"]

    monkeypatch.setattr(flowrl.accel, "compile_adapter", fake_compile)
    trainer = build_trainer(make_cfg("engine.compile=true", "trainer.lora.enabled=true"))
    assert calls == [(True, "inductor")]
    assert trainer.engine.compiled_modules == ["transformer.transformer_blocks.0"]


def test_engine_limits_reach_the_engine(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg("engine.max_batch_rows=6", "engine.decode_chunk_size=3"))
    assert trainer.engine.max_batch_rows == 6 and trainer.engine.executor.decode_chunk_size == 3
    assert trainer.engine.compiled_modules == []


def test_trainer_mixed_precision_reaches_the_engine(build_trainer, make_cfg):
    """Rollouts run under the trainer's autocast, so rollout and trainer log-probs agree."""
    import torch

    trainer = build_trainer(make_cfg("trainer.mixed_precision=bf16"))
    assert trainer.engine.executor.autocast_dtype is torch.bfloat16
    assert build_trainer(make_cfg("trainer.mixed_precision=no", output="b")).engine.executor.autocast_dtype is None


def test_model_text_length_reaches_the_adapter(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg("model.max_sequence_length=16"))
    assert trainer.adapter.max_sequence_length == 16
    assert trainer.adapter.encode_prompts(["a cat"])[0].embeds.shape[0] == 77 + 16
    assert build_trainer(make_cfg(output="b")).adapter.max_sequence_length == 256  # the SD3 default
