"""Regional torch.compile of the engine's hot modules: same results as eager with per-row
timesteps and changing batch sizes, modules stay the same objects, and (on a GPU) no host sync
inside the step loop, eager or compiled."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from flowrl.accel import compile_adapter
from flowrl.bench.models import build_bench_model
from flowrl.engine import SamplingParams
from flowrl.engine.engine import DiffusionEngine
from flowrl.engine.executor import Executor
from flowrl.engine.sample import SampleState

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=3, noise_level=0.7, seed=5)


def _staggered_run(engine, guidance):
    """Requests of different sizes in flight together: forwards of changing batch size where
    rows sit at different steps."""
    params = PARAMS.replace(guidance_scale=guidance)
    futures = engine.submit_batched("a cat", 3, params) + [engine.submit("a dog", params.replace(seed=40))]
    futures += engine.submit_batched("a bird", 2, params.replace(seed=60))
    return [f.result() for f in futures]


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-qwen", "tiny-flux", "tiny-z-image"])
def test_compiled_engine_matches_eager(name):
    torch._dynamo.reset()
    eager_model = build_bench_model(name, "cpu", torch.float32)
    compiled_model = build_bench_model(name, "cpu", torch.float32)
    keys = list(compiled_model.adapter.transformer.state_dict())
    eager = DiffusionEngine(eager_model.adapter)
    compiled = DiffusionEngine(compiled_model.adapter, compile="aot_eager")
    try:
        assert compiled.compiled_modules and all(
            n.startswith(("transformer.", "vae.")) for n in compiled.compiled_modules
        )
        assert list(compiled_model.adapter.transformer.state_dict()) == keys  # no wrapper in the names
        for guidance in (1.0, 3.0):
            for a, b in zip(_staggered_run(eager, guidance), _staggered_run(compiled, guidance)):
                torch.testing.assert_close(b.all_latents, a.all_latents, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(b.all_log_probs, a.all_log_probs, atol=1e-5, rtol=1e-5)
        if name == "tiny-qwen":  # compiled, a batch of one runs as two rows at the model input
            assert compiled_model.adapter.pads_single_row and not eager_model.adapter.pads_single_row
        # Idempotent: a second engine on the same adapter does not wrap the modules again.
        again = DiffusionEngine(compiled_model.adapter, compile="aot_eager")
        assert again.compiled_modules == compiled.compiled_modules
        again.shutdown()
    finally:
        eager.shutdown()
        compiled.shutdown()


@pytest.mark.parametrize("bad", ["turbo", 3])
def test_compile_option_rejects_unknown_values(bad):
    bench = build_bench_model("tiny-sd3", "cpu", torch.float32)
    with pytest.raises(ValueError, match="compile="):
        DiffusionEngine(bench.adapter, compile=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-qwen", "tiny-flux", "tiny-z-image"])
@pytest.mark.parametrize("compile", [False, "aot_eager"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_step_loop_never_syncs_with_the_host(name, compile, guidance):
    """cuda sync debug mode 'error' raises on any host sync (.item(), .tolist(), bool(tensor),
    pageable copies, torch.tensor(list, device='cuda')) inside Executor.step."""
    torch._dynamo.reset()
    bench = build_bench_model(name, "cuda", torch.bfloat16)
    if compile:
        compile_adapter(bench.adapter, compile)
    executor = Executor(bench.adapter)
    params = PARAMS.replace(num_inference_steps=6, guidance_scale=guidance)
    cond, uncond = bench.adapter.encode_prompts(["a cat", ""])
    num_rows = bench.adapter.rows_per_sample(params)  # a guidance-distilled sample takes one row
    samples = []
    for i in range(3):
        s = SampleState(prompt="a cat", params=params, seed=i, sde_window=(0, 5), future=Future(), num_rows=num_rows)
        s.cond, s.uncond = cond, (uncond if num_rows > 1 else None)
        executor.prepare(s)
        samples.append(s)
    executor.step(samples)  # first step: one-time caches (RoPE tables, compilation)
    executor.step(samples[:2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        executor.step(samples)
        executor.step(samples[1:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(s.latents).all() for s in samples)


def test_real_rope_attention_equals_diffusers_processor():
    """The compile-friendly Qwen-Image attention computes the same function as diffusers' own
    processor, padded text (mask) included."""
    from flowrl.accel.qwen_image.block import RealRopeQwenAttention, _real_rope_tables

    adapter = build_bench_model("tiny-qwen", "cpu", torch.float32).adapter
    enc = adapter.encode_prompts(["long prompt", "short"])
    enc[1].embeds, enc[1].mask = enc[1].embeds[:5], enc[1].mask[:5]  # rows of different lengths
    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    args = (latents, torch.tensor([0.9, 0.3]), enc, [None, None], torch.ones(2), 64, 64)
    with torch.no_grad():
        reference = adapter.velocity(*args)
        adapter.transformer.set_attn_processor(RealRopeQwenAttention())
        adapter.transformer.pos_embed.register_forward_hook(_real_rope_tables)
        real = adapter.velocity(*args)
    torch.testing.assert_close(real, reference, atol=1e-6, rtol=1e-6)


def test_no_grad_inductor_options_reach_only_no_grad_calls_of_that_family(monkeypatch):
    """Qwen-Image blocks: calls without autograd (rollout) run a compiled function with the
    family's realize_opcount_threshold, calls with grad (training) one without. SD3: neither."""
    compiled = []
    real_compile = torch.compile

    def recording(fn, **kw):
        if fn.__name__ == "run_checkpointed":  # grad calls with checkpointing (none here)
            return real_compile(fn, backend="eager")
        inner, record = real_compile(fn, backend="eager"), {"options": kw["options"], "calls": 0}
        compiled.append(record)

        def call(*args, **kwargs):
            record["calls"] += 1
            return inner(*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "compile", recording)
    adapter = build_bench_model("tiny-qwen", "cpu", torch.float32).adapter
    blocks = len(compile_adapter(adapter))
    tuned = [r for r in compiled if r["options"].get("realize_opcount_threshold") == 200]
    plain = [r for r in compiled if "realize_opcount_threshold" not in r["options"]]
    assert len(tuned) == len(plain) == blocks == len(compiled) // 2
    assert all(r["options"]["emulate_precision_casts"] is True for r in compiled)
    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    args = (latents, torch.tensor([0.9, 0.3]), adapter.encode_prompts(["a", "b"]), [None, None], torch.ones(2), 64, 64)
    with torch.no_grad():
        adapter.velocity(*args)
    assert [r["calls"] for r in tuned + plain] == [1] * blocks + [0] * blocks
    adapter.velocity(*args)  # grad mode
    assert [r["calls"] for r in tuned + plain] == [1] * (2 * blocks)
    compiled.clear()
    compile_adapter(build_bench_model("tiny-sd3", "cpu", torch.float32).adapter)
    assert compiled and all("realize_opcount_threshold" not in r["options"] for r in compiled)
