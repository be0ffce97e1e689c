"""Fuzzing the config (no model): any value under any key either loads (finite throughout) and passes
the trainer's checks before loading, or raises a ValueError naming that key; NaN and infinity are
rejected in every float."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.config import FlowRLConfig, config_from_dict, config_to_dict, load_config
from flowrl.config.sections import field_types

# Keys whose values name files or folders: checked by their own tests, never fuzzed onto the disk.
FILESYSTEM_KEYS = {"model.path", "data.train_path", "data.val_path", "trainer.output_dir", "trainer.resume"}


def _leaf_types(cls, prefix: str = "") -> dict:
    """Dotted key -> annotation of every setting (a field that is not itself a section)."""
    leaves = {}
    for name, tp in field_types(cls).items():
        leaves.update(_leaf_types(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else {prefix + name: tp})
    return leaves


def _nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


LEAF_TYPES = _leaf_types(FlowRLConfig)
FUZZED_KEYS = sorted(set(LEAF_TYPES) - FILESYSTEM_KEYS)
FLOAT_KEYS = [key for key, tp in LEAF_TYPES.items() if float in (tp, *typing.get_args(tp))]

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 2.5, 1e-4, float("nan"), float("inf"), -float("inf"), 100000, 2**63]),
    st.text(max_size=4),
    st.sampled_from(["auto", "cpu", "cuda", "cuda:3", "host", "device", "sde", "fused", "bf16", "no"]),
    st.lists(st.one_of(st.integers(-2, 12), st.floats(allow_nan=True)), max_size=3),
)


def _floats(node):
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        return [x for item in node for x in _floats(item)]
    return [node] if isinstance(node, float) else []


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz_out"))


@pytest.fixture(scope="module")
def no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the fuzz expects model.device=cuda to be refused (no GPU visible)")


def test_every_invalid_value_is_a_value_error_naming_the_key(output_dir, no_gpu):
    from flowrl.run.checks import check_before_loading

    @settings(max_examples=150, deadline=None)
    @given(key=st.sampled_from(FUZZED_KEYS), value=ANY_VALUE)
    def check(key, value):
        try:
            cfg = config_from_dict(_nested(key, value))
        except ValueError as error:
            assert key in str(error), f"{key}={value!r}: {error}"
            return
        # Accepted: every number finite...
        assert all(math.isfinite(v) for v in _floats(config_to_dict(cfg))), f"{key}={value!r} was accepted"
        # ...and the trainer's checks before loading pass or name the key (the reward is stubbed).
        cfg.trainer.output_dir = output_dir
        try:
            check_before_loading(cfg, reward=object())
        except ValueError as error:
            assert key in str(error), f"{key}={value!r}: {error}"

    check()


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_float_rejects_nan_and_infinity(key, bad):
    assert {"trainer.lr", "algorithm.clip_range", "rollout.sampling.guidance_scale"} <= set(FLOAT_KEYS)
    with pytest.raises(ValueError, match=re.escape(key)):
        config_from_dict(_nested(key, bad))


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lr=.nan", "trainer.lr"),
        ("rollout.sampling.guidance_scale=.inf", "rollout.sampling.guidance_scale"),
        ("trainer.betas=[0.9, .nan]", "trainer.betas.1"),
        ("reward.components=[{name: ocr, weight: .nan}]", "reward.components.0.weight"),
        ("reward.options={scale: -.inf}", "reward.options.scale"),
    ],
)
def test_non_finite_yaml_values_are_rejected(override, key):
    overrides = [override, "reward.name=null"] if "components" in override else [override]
    with pytest.raises(ValueError, match=re.escape(key) + "=(nan|inf|-inf)"):
        load_config(None, overrides)


def test_a_hand_built_config_is_checked_too():
    cfg = FlowRLConfig()
    cfg.algorithm.clip_range = math.nan
    with pytest.raises(ValueError, match="algorithm.clip_range=nan"):
        cfg.validate()
