"""Fuzzing SamplingParams through the engine: any value in any field either is accepted or raises a
ValueError naming that field before anything is queued; the engine then serves a valid request,
and accepted settings really generate."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.sampling_params import SamplingParams

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 40),
    st.integers(-(2**70), 2**70),
    st.sampled_from([16, 48, 64, 96, 512, 528, 1024, 4096, 100000, 2**63 - 1, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 4.5, float("nan"), float("inf"), -float("inf")]),
    st.text(max_size=4),
    st.sampled_from(["sde", "cps", "ddim", "64"]),
    st.lists(st.integers(-3, 12), max_size=3),
    st.tuples(st.integers(-3, 12), st.integers(-3, 12)),
)


def _base(params: SamplingParams) -> SamplingParams:
    return params.replace(num_inference_steps=4, seed=3)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE, num_outputs=st.integers(1, 3))
def _fuzz_one_field(engine, base, queued, field, value, num_outputs):
    params = base.replace(**{field: value})
    before = len(queued)
    try:
        engine.submit_batched("a cat", num_outputs, params)
    except ValueError as error:
        assert field in str(error), f"{field}={value!r}: {error}"
        assert len(queued) == before  # nothing was queued
    else:
        assert len(queued) == before + 1
        # Accepted means the model can take it; the engine's own checks agree with validate().
        params.validate(engine.adapter.size_multiple, engine.adapter.max_image_side, num_outputs)


def test_every_invalid_value_is_a_value_error_naming_the_field(sd3_engine, params):
    queued = []
    sd3_engine._enqueue = queued.append  # record instead of generating
    try:
        _fuzz_one_field(sd3_engine, _base(params), queued)
    finally:
        del sd3_engine._enqueue
    assert sd3_engine.generate("a cat", _base(params)).image.shape == (3, 64, 64)


CHEAP_VALID = st.builds(
    SamplingParams,
    height=st.sampled_from([32, 64]),
    width=st.sampled_from([32, 48, 64]),
    num_inference_steps=st.integers(2, 4),
    guidance_scale=st.sampled_from([0.0, 1.0, 2.5]),
    negative_prompt=st.one_of(st.none(), st.text(max_size=8)),
    noise_level=st.sampled_from([0.0, 0.3, 1.0]),
    sde_type=st.sampled_from(["sde", "cps"]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 4)),
    logprobs=st.booleans(),
)


@pytest.mark.parametrize("family", ["sd3", "qwen_image"])
def test_accepted_settings_generate(family, request):
    engine = request.getfixturevalue({"sd3": "sd3_engine", "qwen_image": "qwen_engine"}[family])

    @settings(max_examples=12, deadline=None)
    @given(params=CHEAP_VALID, num_outputs=st.integers(1, 3))
    def check(params, num_outputs):
        params = params.replace(logprobs=params.logprobs and params.noise_level > 0)  # else invalid
        for future in engine.submit_batched("a cat", num_outputs, params):
            output = future.result(timeout=60)
            assert output.image.shape == (3, params.height, params.width)

    check()
