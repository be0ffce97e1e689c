"""flowrl.accel.qwen_image.prefix_attention: a padded batch's joint attention as one unmasked call
per run of equal text lengths computes the masked attention, values and gradients, eager and
compiled; the Qwen-Image blocks take it in forwards without grad, where the adapter passes the
rows' text lengths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image import TransformerCallHook, install
from flowrl.accel.qwen_image import prefix_attention as pa
from flowrl.bench.models import build_bench_model


def _sequence_major(batch: int, heads: int, tokens: int, dim: int, device="cpu", dtype=torch.float32):
    """A (B, H, S, D) view of a new (S, B, H, D) tensor, as the blocks pass q, k and v."""
    return torch.randn(tokens, batch, heads, dim, device=device, dtype=dtype).permute(1, 2, 0, 3).requires_grad_(True)


def _masked_and_prefix(kv_lengths: list[int], call=pa.attention, device="cpu", dtype=torch.float32, heads=2, dim=16):
    """(masked SDPA's output and q, k, v gradients, the same of `call`) for one random batch."""
    torch.manual_seed(0)
    tokens = max(kv_lengths) + 3  # padded past every row's keys
    q, k, v = (_sequence_major(len(kv_lengths), heads, tokens, dim, device, dtype) for _ in range(3))
    lengths = torch.tensor(kv_lengths)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(device)[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn_like(want)
    got = call(q, k, v, lengths)
    results = []
    for out in (want, got):
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    return results


@pytest.mark.parametrize(
    "kv_lengths",
    [
        [9, 9, 7, 7, 7, 12],  # runs of several lengths, the longest last
        [12, 12, 12, 12],  # one run: every row sees the same prefix
        [5, 12, 5, 12],  # runs of one row
    ],
)
def test_equals_masked_attention_values_and_gradients(kv_lengths):
    (want, *want_grads), (got, *got_grads) = _masked_and_prefix(kv_lengths)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    assert got.transpose(1, 2).transpose(0, 1).is_contiguous()  # the blocks' sequence-major layout
    # The keys past a row's prefix are masked: their gradients are exactly zero.
    dk = got_grads[1]
    for row, keys in enumerate(kv_lengths):
        assert (dk[row, :, keys:] == 0).all()


def test_compiled_equals_masked_attention():
    compiled = torch.compile(lambda q, k, v, lengths: pa.attention(q, k, v, lengths) * 2, backend="inductor")
    (want, *want_grads), (got, *got_grads) = _masked_and_prefix([9, 9, 4, 12], compiled)
    torch.testing.assert_close(got, 2 * want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, 2 * w, atol=1e-5, rtol=1e-5)


def test_runs_and_where_it_applies():
    assert pa.runs(torch.tensor([3, 3, 5, 3])) == [(0, 2, 3), (2, 3, 5), (3, 4, 3)]
    assert pa.applies(torch.zeros(2, 1, 4, 8))
    assert pa.few_runs([4, 2]) and not pa.few_runs([1, 2] * pa.MAX_RUNS)  # then the masked call is kept
    q, k, v, lengths = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8), torch.tensor([2, 0])
    torch.library.opcheck(torch.ops.flowrl.prefix_attention, (q, k, v, lengths, 2))


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    return build_bench_model("tiny-qwen", "cpu", torch.float32).adapter


def _ragged_velocity_args(adapter):
    """adapter.velocity's inputs for 3 rows whose texts have 16, 5 and 16 tokens, with CFG (a
    negative prompt of 3 tokens): a padded batch of 6 rows in 4 runs of equal lengths."""
    enc = adapter.encode_prompts(["long prompt", "short", "x"])
    enc[1].embeds, enc[1].mask = enc[1].embeds[:5], enc[1].mask[:5]
    negative = adapter.encode_prompts(["negative"])[0]
    negative.embeds, negative.mask = negative.embeds[:3], negative.mask[:3]
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn((3, *adapter.latent_shape(64, 64)), generator=gen)
    return (latents, torch.tensor([0.9, 0.3, 0.5]), enc, [negative] * 3, torch.full((3,), 4.0), 64, 64)


def test_rollout_blocks_take_it_from_the_hook_with_diffusers_values(stock, monkeypatch):
    calls = []
    real = pa.attention
    monkeypatch.setattr(
        pa, "attention", lambda *a, **kw: calls.append((a[3] + kw["key_offset"]).tolist()) or real(*a, **kw)
    )
    args = _ragged_velocity_args(stock)
    results = {}
    for name, options in (("prefix", AccelOptions()), ("masked", AccelOptions(prefix_attention=False))):
        adapter = copy.deepcopy(stock)
        install(adapter, options)
        results[name] = adapter
    blocks = len(stock.transformer.transformer_blocks)
    outputs = {}
    for name, adapter in (("diffusers", stock), *results.items()):
        calls.clear()
        with torch.no_grad():
            outputs[name] = adapter.velocity(*args)
        image_tokens = (64 // 16) ** 2  # the tiny model's 64 px image: 4 x 4 patches
        lengths = [16, 5, 16, 3, 3, 3]
        assert calls == ([[image_tokens + n for n in lengths]] * blocks if name == "prefix" else [])
        calls.clear()
        adapter.velocity(*args)  # with grad: the masked call
        assert calls == []
    for name in ("prefix", "masked"):
        torch.testing.assert_close(outputs[name], outputs["diffusers"], atol=1e-5, rtol=1e-5)


def test_hook_passes_lengths_only_to_no_grad_forwards_with_padded_text(stock):
    adapter = copy.deepcopy(stock)
    hook = TransformerCallHook(adapter, AccelOptions())
    with torch.no_grad():
        assert hook(2, None, None) == (False, None)
        padded, kwargs = hook(1, None, [4])  # a batch of one runs as two rows
        assert padded and kwargs[pa.TEXT_LENGTHS_KEY].tolist() == [4, 4]
        assert kwargs[pa.TEXT_LENGTHS_KEY].device.type == "cpu"
        assert TransformerCallHook(adapter, AccelOptions(prefix_attention=False))(2, None, [4, 2]) == (False, None)
        assert hook(2 * pa.MAX_RUNS, None, [1, 2] * pa.MAX_RUNS) == (False, None)  # too many runs: masked
    assert hook(2, None, [4, 2]) == (False, None)  # with grad: the training graphs keep the masked call


def test_compiled_blocks_trace_it_whole_for_any_lengths(stock):
    """The compiled blocks read no lengths' values while tracing: no graph break inside a block,
    and new lengths reuse the compiled graphs. (The run count used to be decided inside the block,
    from the lengths tensor: a graph break in every block call.)"""
    from torch._dynamo.utils import counters

    from flowrl.accel import compile_adapter

    adapter = copy.deepcopy(stock)
    compile_adapter(adapter, "aot_eager")
    args = list(_ragged_velocity_args(stock))
    calls = []
    real = pa._forward
    counters.clear()
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(pa, "_forward", lambda *a: calls.append(1) or real(*a))  # the op's runs, when they run
        for text in (5, 9):  # the second prompt's length, then another one
            args[2] = adapter.encode_prompts(["long prompt", "short", "x"])
            args[2][1].embeds, args[2][1].mask = args[2][1].embeds[:text], args[2][1].mask[:text]
            adapter.velocity(*args)
    assert calls, "the compiled blocks did not take the per-run attention"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph for every block


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_runs_equal_masked_attention(dtype):
    """On CUDA (cuDNN's kernel, per run) against SDPA's masked call at Qwen-Image's head width: equal
    up to the half-precision rounding of the two kernels' sums."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q = torch.zeros(6, 3, 100, 128, device="cuda", dtype=dtype)
    if not pa.applies(q):
        pytest.skip("PyTorch does not run cuDNN attention on this GPU")
    (want, *want_grads), (got, *got_grads) = _masked_and_prefix(
        [90, 90, 61, 61, 61, 97], device="cuda", dtype=dtype, heads=3, dim=128
    )
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
