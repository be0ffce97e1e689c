"""AgentLoop: the batched path and the fallback give the same samples and layout; each
precondition alone forces the fallback; row metadata stays on its row; replicas."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from flowrl.config import RolloutConfig
from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.rollout import AgentLoop, RolloutBatch
from flowrl.rollout import agent_loop as agent_loop_module

ATOL = 1e-5
SAMPLING = SamplingParams(height=64, width=64, num_inference_steps=4, noise_level=0.7)


@pytest.fixture(scope="module")
def engine(tiny_qwen_path):
    eng = DiffusionEngine.from_pretrained(tiny_qwen_path, max_batch_rows=16)
    yield eng
    eng.shutdown()


def make_config(**changes):
    return RolloutConfig(**{"n": 4, "seed": 5, "sampling": SAMPLING, **changes})


def make_batch(n=4):
    rows = [
        {"raw_prompt": "a photo of a cat", "ground_truth": "cat", "data_source": "animals", "uid": "u-cat"},
        {"raw_prompt": "a red sign with the word open", "ground_truth": "open", "data_source": "ocr", "uid": "u-sign"},
    ]
    return RolloutBatch.from_rows(rows).repeat(n, interleave=True)


def assert_same_samples(a: RolloutBatch, b: RolloutBatch):
    assert list(a.non_tensor_batch["raw_prompt"]) == list(b.non_tensor_batch["raw_prompt"])
    assert list(a.non_tensor_batch["seed"]) == list(b.non_tensor_batch["seed"])
    assert set(a.batch) == set(b.batch)
    for name in ("all_latents", "all_log_probs", "prompt_embeds"):
        torch.testing.assert_close(a.batch[name], b.batch[name], atol=ATOL, rtol=0)


def test_flag_on_and_off_give_identical_outputs_and_layout(engine):
    on = AgentLoop(engine, make_config()).generate_sequences(make_batch())
    off = AgentLoop(engine, make_config(enable_batched_diffusion=False)).generate_sequences(make_batch())
    assert on.meta_info["num_batched_groups"] == 2 and on.meta_info["num_single_requests"] == 0
    assert on.meta_info["fallback_reason"] is None
    assert off.meta_info["num_batched_groups"] == 0 and off.meta_info["num_single_requests"] == 8
    assert "enable_batched_diffusion" in off.meta_info["fallback_reason"]
    assert_same_samples(on, off)
    assert on.batch["images"].shape == (8, 3, 64, 64) and on.batch["images"].dtype == torch.uint8
    assert on.batch["all_log_probs"].shape == (8, 3)
    # Rows of a group got consecutive seeds, and different groups different seeds.
    seeds = list(on.non_tensor_batch["seed"])
    assert seeds[:4] == list(range(seeds[0], seeds[0] + 4)) and len(set(seeds)) == 8


@pytest.mark.parametrize("path", ["batched", "fallback"])
def test_row_metadata_stays_on_its_row(engine, path):
    config = make_config(enable_batched_diffusion=(path == "batched"))
    out = AgentLoop(engine, config).generate_sequences(make_batch())
    nt = out.non_tensor_batch
    for i in range(8):
        cat = i < 4
        assert nt["uid"][i] == ("u-cat" if cat else "u-sign")
        assert nt["ground_truth"][i] == ("cat" if cat else "open")
        assert nt["data_source"][i] == ("animals" if cat else "ocr")
    own = engine.adapter.encode_prompts(["a red sign with the word open"])[0]
    length = own.embeds.shape[0]
    torch.testing.assert_close(out.batch["prompt_embeds"][5, :length], own.embeds, atol=ATOL, rtol=0)


def _violations():
    """Each entry breaks exactly one precondition of the batched path."""

    def odd_prompt(batch):
        batch.non_tensor_batch["raw_prompt"][2] = "a blue poster"
        return batch

    def odd_negative(batch):
        batch.non_tensor_batch["negative_prompt"][1] = "blurry"
        return batch

    def odd_agent(batch):
        batch.non_tensor_batch["agent_name"][3] = "diffusion_b"
        return batch

    def odd_sampling(batch):
        batch.add_non_tensors({"sampling_overrides": [None] * 6 + [{"noise_level": 0.5}] + [None]})
        return batch

    return {
        "flag off": ({"enable_batched_diffusion": False}, lambda b: b, "enable_batched_diffusion"),
        "n=1": ({"n": 1}, lambda b: b, "rollout.n=1"),
        "len % n": ({}, lambda b: b.select(range(7)), "not a multiple"),
        "raw_prompt": ({}, odd_prompt, "raw_prompt"),
        "negative_prompt": ({}, odd_negative, "negative_prompt"),
        "agent_name": ({}, odd_agent, "agent_name"),
        "sampling": ({}, odd_sampling, "sampling settings"),
    }


@pytest.mark.parametrize("case", list(_violations()))
def test_each_violated_precondition_alone_falls_back_and_stays_correct(engine, case, monkeypatch):
    monkeypatch.setattr(agent_loop_module, "KNOWN_AGENTS", ("diffusion", "diffusion_b"))
    changes, mutate, reason = _violations()[case]
    batch = mutate(make_batch())
    loop = AgentLoop(engine, make_config(**changes))
    out = loop.generate_sequences(batch)
    assert reason in out.meta_info["fallback_reason"]
    assert out.meta_info["num_single_requests"] == len(batch)
    # Every row's sample is exactly the solo generation with that row's own prompt and settings.
    for i in range(len(batch)):
        params = loop._row_params(batch, i, SAMPLING).replace(seed=int(out.non_tensor_batch["seed"][i]))
        prompt = batch.non_tensor_batch["raw_prompt"][i]
        solo = engine.generate(prompt, params)
        torch.testing.assert_close(out.batch["all_latents"][i], solo.all_latents, atol=ATOL, rtol=0)
        length = solo.prompt_embeds.shape[0]
        torch.testing.assert_close(out.batch["prompt_embeds"][i, :length], solo.prompt_embeds, atol=ATOL, rtol=0)


def test_engine_without_batched_support_falls_back(engine):
    class SinglesOnly:
        supports_batched_generation = False

        def submit(self, prompt, params):
            return engine.submit(prompt, params)

    out = AgentLoop(SinglesOnly(), make_config()).generate_sequences(make_batch())
    assert "does not support batched" in out.meta_info["fallback_reason"]
    reference = AgentLoop(engine, make_config()).generate_sequences(make_batch())
    assert_same_samples(out, reference)


def test_seeds_are_reproducible_and_advance_with_the_global_row_index(engine):
    loop_a, loop_b = AgentLoop(engine, make_config()), AgentLoop(engine, make_config())
    first_a, first_b = loop_a.generate_sequences(make_batch()), loop_b.generate_sequences(make_batch())
    assert list(first_a.non_tensor_batch["seed"]) == list(first_b.non_tensor_batch["seed"])
    second = loop_a.generate_sequences(make_batch())
    assert set(second.non_tensor_batch["seed"]).isdisjoint(first_a.non_tensor_batch["seed"])
    fresh = AgentLoop(engine, make_config(seed=None))
    x, y = fresh.generate_sequences(make_batch()), fresh.generate_sequences(make_batch())
    assert set(x.non_tensor_batch["seed"]).isdisjoint(y.non_tensor_batch["seed"])


def test_validation_mode_is_ode_with_fixed_seeds(engine):
    config = make_config(val_sampling=SAMPLING.replace(noise_level=0.0, logprobs=False))
    loop = AgentLoop(engine, config)
    a = loop.generate_sequences(make_batch(), validation=True)
    loop.generate_sequences(make_batch())  # a training rollout in between
    b = loop.generate_sequences(make_batch(), validation=True)
    assert "all_log_probs" not in a.batch
    torch.testing.assert_close(a.batch["all_latents"], b.batch["all_latents"], atol=0, rtol=0)


class _Recording:
    """An engine whose calls are recorded: (method, number of prompts, samples per prompt)."""

    supports_batched_generation = True
    is_in_process = True

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def submit(self, prompt, params):
        self.calls.append(("submit", 1, 1))
        return self.engine.submit(prompt, params)

    def submit_batched(self, prompt, n, params):
        self.calls.append(("submit_batched", 1, n))
        return self.engine.submit_batched(prompt, n, params)

    def submit_many(self, prompts, params, n=1):
        self.calls.append(("submit_many", len(prompts), n))
        return self.engine.submit_many(prompts, params, n)


def test_rows_that_differ_in_prompt_and_seed_only_are_queued_as_one_call(engine):
    config = make_config(val_sampling=SAMPLING.replace(noise_level=0.0, logprobs=False))
    recording = _Recording(engine)
    out = AgentLoop(recording, config).generate_sequences(make_batch(n=1), validation=True)
    assert recording.calls == [("submit_many", 2, 1)]
    # The same samples as one single request per row (an engine without submit_many)
    singles = _Recording(engine)
    singles.submit_many = None
    reference = AgentLoop(singles, config).generate_sequences(make_batch(n=1), validation=True)
    assert singles.calls == [("submit", 1, 1), ("submit", 1, 1)]
    assert list(out.non_tensor_batch["seed"]) == list(reference.non_tensor_batch["seed"])
    torch.testing.assert_close(out.batch["all_latents"], reference.batch["all_latents"], atol=ATOL, rtol=0)
    # Over two engines each row goes to the least busy one, as a single request.
    a, b = _Recording(engine), _Recording(engine)
    AgentLoop([a, b], config).generate_sequences(make_batch(n=1), validation=True)
    assert a.calls == b.calls == [("submit", 1, 1)]
    # Rows whose settings differ are single requests, as before.
    batch = make_batch(n=1)
    batch.non_tensor_batch["sampling_overrides"] = np.array([None, {"noise_level": 0.5}], dtype=object)
    recording.calls.clear()
    AgentLoop(recording, make_config()).generate_sequences(batch)
    assert recording.calls == [("submit", 1, 1), ("submit", 1, 1)]


def test_groups_of_a_training_batch_on_one_engine_are_queued_as_one_call(engine):
    recording = _Recording(engine)
    out = AgentLoop(recording, make_config()).generate_sequences(make_batch())
    assert recording.calls == [("submit_many", 2, 4)]
    assert out.meta_info["num_batched_groups"] == 2
    # The same samples, and one SDE window per group, as one submit_batched call per group
    per_group = _Recording(engine)
    per_group.submit_many = None
    reference = AgentLoop(per_group, make_config()).generate_sequences(make_batch())
    assert per_group.calls == [("submit_batched", 1, 4), ("submit_batched", 1, 4)]
    assert_same_samples(out, reference)
    assert list(out.non_tensor_batch["sde_window"]) == list(reference.non_tensor_batch["sde_window"])
    # Over two engines each group goes to the least busy one.
    a, b = _Recording(engine), _Recording(engine)
    AgentLoop([a, b], make_config()).generate_sequences(make_batch())
    assert a.calls == b.calls == [("submit_batched", 1, 4)]
    # A remote engine answers a call's samples in one response, within its server's per-request
    # limit: each group is a request of its own.
    remote = _Recording(engine)
    remote.is_in_process = False
    AgentLoop(remote, make_config()).generate_sequences(make_batch())
    assert remote.calls == [("submit_batched", 1, 4), ("submit_batched", 1, 4)]


@pytest.mark.parametrize("samples_per_prompt, expected", [(1, {2: 4, 3: 4}), (2, {2: 4, 4: 4})])
def test_an_eval_batch_is_grouped_into_forwards_the_same_way_every_time(tiny_qwen_path, samples_per_prompt, expected):
    """Queued as one call, the engine admits the rows in order up to max_batch_rows, at every one
    of the 4 steps, on every run. Separate calls (one per row, or one per group) reached the
    engine one by one, so its first forward could start with fewer rows: the engine here pauses
    after each request it queues, as a busy host may, which made that happen."""
    prompts = [{"raw_prompt": f"prompt {i}", "uid": f"u{i}"} for i in range(5 if samples_per_prompt == 1 else 3)]
    rows = RolloutBatch.from_rows(prompts).repeat(samples_per_prompt, interleave=True)
    config = make_config(n=samples_per_prompt, val_sampling=SAMPLING.replace(noise_level=0.0, logprobs=False))
    max_batch_rows = 3 if samples_per_prompt == 1 else 4
    with DiffusionEngine.from_pretrained(tiny_qwen_path, max_batch_rows=max_batch_rows) as small:
        enqueue = small._enqueue

        def enqueue_then_pause(requests):
            enqueue(requests)
            time.sleep(0.05)

        small._enqueue = enqueue_then_pause
        loop = AgentLoop(small, config)
        for _ in range(3):
            small.reset_stats()
            loop.generate_sequences(rows, validation=True)
            assert small.stats()["rows_per_forward_hist"] == expected


def test_on_sample_done_sees_every_row(engine):
    seen = []
    out = AgentLoop(engine, make_config()).generate_sequences(
        make_batch(), on_sample_done=lambda row, o: seen.append((row, o.seed))
    )
    assert sorted(seen) == sorted(enumerate(out.non_tensor_batch["seed"]))


def test_replicas_balance_and_keep_groups_whole(tiny_qwen_path):
    engines = [DiffusionEngine.from_pretrained(tiny_qwen_path, max_batch_rows=16) for _ in range(2)]
    try:
        loop = AgentLoop(engines, make_config())
        out = loop.generate_sequences(make_batch())
        assert loop.balancer.assigned == [4, 4]  # one group per replica
        assert [e.stats()["num_samples_finished"] for e in engines] == [4, 4]
        reference = AgentLoop(engines[0], make_config()).generate_sequences(make_batch())
        assert_same_samples(out, reference)
    finally:
        for e in engines:
            e.shutdown()


def test_unknown_agent_is_a_clear_error(engine):
    batch = make_batch()
    batch.non_tensor_batch["agent_name"][0] = "chat"
    with pytest.raises(ValueError, match="agent_name='chat'"):
        AgentLoop(engine, make_config()).generate_sequences(batch)


def test_every_callback_has_returned_when_generate_sequences_returns(engine):
    import time as _time

    finished = []

    def slow(row, output):
        _time.sleep(0.01)  # a slow callback must still be complete when the rollout returns
        finished.append(row)

    out = AgentLoop(engine, make_config()).generate_sequences(make_batch(), on_sample_done=slow)
    assert sorted(finished) == list(range(len(out)))


def test_validation_fallback_is_not_logged_as_a_warning(engine, caplog):
    batch = RolloutBatch.from_rows([{"raw_prompt": "a cat"}, {"raw_prompt": "a dog"}])
    loop = AgentLoop(engine, make_config(val_sampling=SAMPLING.replace(noise_level=0.0, logprobs=False)))
    with caplog.at_level("WARNING"):
        out = loop.generate_sequences(batch, validation=True)
    assert "not a multiple" in out.meta_info["fallback_reason"]
    assert not [r for r in caplog.records if "batched diffusion not used" in r.getMessage()]
