"""Requests that arrive at different times and steps share forwards, and stay exact."""

from __future__ import annotations

import pytest
import torch

from flowrl.engine import DiffusionEngine

ATOL = 1e-5


class ArrivalHook:
    """Wraps adapter.velocity: before forward number k, submits the requests scheduled for k
    (from inside the engine thread, so the arrival step is deterministic) and records the batch
    size of every forward."""

    def __init__(self, engine, arrivals):
        self.engine = engine
        self.arrivals = arrivals  # forward index -> list of (prompt, params)
        self.futures = []
        self.rows = []
        self.inner = engine.adapter.velocity
        self.count = 0

    def __call__(self, latents, *args, **kwargs):
        for prompt, params in self.arrivals.get(self.count, []):
            self.futures.append((prompt, params, self.engine.submit(prompt, params)))
        self.count += 1
        self.rows.append(latents.shape[0])  # samples in this forward (CFG rows are added inside)
        return self.inner(latents, *args, **kwargs)


@pytest.fixture(params=["sd3", "qwen_image"])
def fresh_engine(request, tiny_sd3_path, tiny_qwen_path):
    path = tiny_sd3_path if request.param == "sd3" else tiny_qwen_path
    engine = DiffusionEngine.from_pretrained(path, max_batch_rows=8)
    yield engine
    engine.shutdown()


def test_staggered_requests_share_forwards_and_match_solo(fresh_engine, params):
    engine = fresh_engine
    # Different prompts (different text lengths for Qwen-Image), joining at forwards 1, 2 and 4.
    arrivals = {
        1: [("a dog", params.replace(seed=21))],
        2: [("a red poster with the word hello written on it", params.replace(seed=22))],
        4: [("open", params.replace(seed=23, guidance_scale=3.0, negative_prompt="blurry"))],
    }
    hook = ArrivalHook(engine, arrivals)
    engine.adapter.velocity = hook
    try:
        first = engine.submit("a photo of a cat", params.replace(seed=20))
        outputs = [("a photo of a cat", params.replace(seed=20), first.result())]
        while len(hook.futures) < 3:  # the hook submits the late requests while the first runs
            engine.wait_until_idle()
        engine.wait_until_idle()
        outputs += [(p, sp, f.result()) for p, sp, f in hook.futures]
    finally:
        del engine.adapter.velocity  # back to the class method
    stats = engine.stats()
    # A request submitted before forward k joins at forward k + 1, whatever step the others are at:
    # forward 3 steps three samples sitting at steps 3, 1 and 0 (hook.rows counts samples, not rows).
    assert hook.rows[:6] == [1, 1, 2, 3, 3, 4], hook.rows
    assert max(stats["rows_per_forward_hist"]) >= 5
    assert stats["num_forwards"] < 4 * params.num_inference_steps
    for prompt, sp, out in outputs:
        solo = engine.generate(prompt, sp)
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)


def test_max_batch_rows_bounds_every_forward(tiny_sd3_path, params):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_rows=3)
    try:
        cfg = params.replace(guidance_scale=2.0)
        futures = engine.submit_batched("a cat", 4, params) + engine.submit_batched("a dog", 2, cfg)
        outs = [f.result() for f in futures]
        hist = engine.stats()["rows_per_forward_hist"]
        assert max(hist) <= 3 and len(outs) == 6
        solo = engine.generate("a dog", cfg.replace(seed=params.seed + 1))
        torch.testing.assert_close(outs[5].all_latents, solo.all_latents, atol=ATOL, rtol=0)
    finally:
        engine.shutdown()


def test_different_image_sizes_take_turns(tiny_sd3_path, params):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_rows=16)
    try:
        small = engine.submit_batched("a cat", 2, params)
        large = engine.submit_batched("a cat", 2, params.replace(height=96, width=128))
        outs = [f.result() for f in small + large]
        assert [tuple(o.image.shape) for o in outs] == [(3, 64, 64)] * 2 + [(3, 96, 128)] * 2
        # Never mixed in one forward: every forward has 2 rows (one shape group).
        assert set(engine.stats()["rows_per_forward_hist"]) == {2}
        solo = engine.generate("a cat", params.replace(height=96, width=128, seed=params.seed + 1))
        torch.testing.assert_close(outs[3].all_latents, solo.all_latents, atol=ATOL, rtol=0)
    finally:
        engine.shutdown()


def test_qwen_padded_prompts_of_different_lengths(qwen_engine, params):
    prompts = ["cat", "a photo of a dog on the street", "a red poster with the word hello written on it in blue text"]
    encodings = qwen_engine.adapter.encode_prompts(prompts)
    assert len({e.embeds.shape[0] for e in encodings}) == 3  # really different lengths
    outs = qwen_engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        solo = qwen_engine.generate(prompt, params.replace(seed=out.seed))
        torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)
        assert out.prompt_embeds.shape[0] == out.prompt_embeds_mask.sum()
