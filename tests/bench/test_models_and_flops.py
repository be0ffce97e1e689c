"""The benchmarks' models (random prompts, shared modules) and FLOP counting."""

from __future__ import annotations

import pytest
import torch

from flowrl.bench.models import build_bench_model
from flowrl.run import flops


def test_random_prompts_are_fixed_per_text_and_shaped_like_the_encoders():
    bench = build_bench_model("tiny-sd3", "cpu", torch.float32)
    a, b, a_again = bench.adapter.encode_prompts(["a", "b", "a"])
    assert a.embeds.shape == (77 + 32, 64) and a.pooled.shape == (64,) and bool(a.mask.all())
    assert torch.equal(a.embeds, a_again.embeds) and not torch.equal(a.embeds, b.embeds)
    assert bench.pipeline.transformer is bench.adapter.transformer and bench.pipeline.vae is bench.adapter.vae


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-qwen", "tiny-flux", "tiny-z-image"])
def test_flops_count_attention_and_scale_with_rows(name):
    bench = build_bench_model(name, "cpu", torch.float32)
    adapter = bench.adapter
    per_row = flops.transformer_flops_per_row(adapter, 64, 64)
    enc = adapter.encode_prompts(["x", "y"])
    latents = torch.randn((2, *adapter.latent_shape(64, 64)))
    guidance = adapter.guidance_embedding_kwargs(torch.full((2,), 3.5))
    with torch.no_grad():
        two_rows = flops.count_flops(
            lambda: adapter.velocity(
                latents, torch.full((2,), 0.5), enc, [None, None], torch.ones(2), 64, 64, **guidance
            )
        )
        q = torch.randn(1, 2, 128, 16)
        attention = flops.count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert two_rows == 2 * per_row
    assert attention == 2 * 2 * 128 * 128 * (16 + 16)  # counted on CPU too
    assert flops.decode_flops_per_image(adapter, 64, 64) > 0


def test_matmul_peak_is_positive_and_sustained_runs_longer():
    peak = flops.measure_matmul_peak(torch.device("cpu"), torch.float32, size=128, sustain_seconds=0.02)
    assert peak["burst_flops"] > 0 and peak["sustained_flops"] > 0 and peak["sustained_products"] >= 10


def test_counting_flops_leaves_compiled_modules_compiled():
    """Before count_flops ran compiled modules eagerly, dynamo met its dispatch mode and gave up
    on the code object every in-place compiled module shares, so each later call ran eager: the
    training-step profile of run 35 showed eager kernels only. Calls after a count must still
    enter the compiled region."""
    from torch.profiler import ProfilerActivity, profile

    from flowrl.accel.regional_compile import compile_in_place
    from flowrl.run.flops import count_flops

    class Block(torch.nn.Module):  # a forward outside torch's files, which dynamo never traces
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    module = Block()
    compile_in_place(module, "inductor")
    x = torch.randn(4, 8)
    module(x)  # compiles

    def compiled_regions() -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            module(x)
        return sum(e.count for e in prof.key_averages() if e.key.startswith("Torch-Compiled Region"))

    assert compiled_regions() == 1
    assert count_flops(lambda: module(x)) == 2 * (2 * 4 * 8 * 8)  # two 4x8 @ 8x8 GEMMs
    assert compiled_regions() == 1
