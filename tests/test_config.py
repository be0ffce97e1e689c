"""Config loading: defaults, YAML + dotted overrides, strict key/type errors, validation, CLI."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from flowrl.config import (
    FlowRLConfig,
    RolloutConfig,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
)
from flowrl.run.resume import flatten as _flatten
from flowrl.sampling_params import SamplingParams


def test_defaults_load_as_plain_dataclasses():
    cfg = load_config(None, [])
    assert cfg == FlowRLConfig().validate()
    assert isinstance(cfg.rollout, RolloutConfig)
    assert type(cfg.rollout.sampling) is SamplingParams and type(cfg.rollout.val_sampling) is SamplingParams
    assert isinstance(cfg.trainer.betas, tuple)
    assert cfg.rollout.enable_batched_diffusion is True and cfg.rollout.n >= 2
    # Validation samples are ODE without log-probs; training samples are SDE with log-probs.
    assert cfg.rollout.val_sampling.noise_level == 0 and not cfg.rollout.val_sampling.logprobs
    assert cfg.rollout.sampling.noise_level > 0 and cfg.rollout.sampling.logprobs


def test_overrides_change_exactly_their_keys():
    overrides = {
        "rollout.n": 16,
        "rollout.enable_batched_diffusion": False,
        "rollout.sampling.guidance_scale": 4.5,
        "rollout.sampling.sde_window": [1, 3],
        "algorithm.clip_range": 1e-5,
        "trainer.lora.target_modules": ["to_q", "add_q_proj"],
        "reward.options.quality": 90,
        "model.path": "/models/sd35",
    }
    texts = [
        "rollout.n=16",
        "rollout.enable_batched_diffusion=false",
        "rollout.sampling.guidance_scale=4.5",
        "rollout.sampling.sde_window=[1,3]",
        "algorithm.clip_range=1e-5",
        "trainer.lora.target_modules=[to_q,add_q_proj]",
        "reward.options.quality=90",
        "model.path=/models/sd35",
    ]
    cfg = load_config(None, texts)
    before, after = _flatten(config_to_dict(load_config(None, []))), _flatten(config_to_dict(cfg))
    changed = {key for key in after if before.get(key) != after[key]}
    assert changed == set(overrides)
    assert all(after[key] == value for key, value in overrides.items())
    assert cfg.rollout.sampling.sde_window == (1, 3)  # a real tuple, not a list or ListConfig
    assert load_config(None, ["trainer.mixed_precision=no"]).trainer.mixed_precision == "no"
    assert type(cfg.rollout.sampling) is SamplingParams


def test_yaml_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("rollout:\n  n: 8\n  sampling:\n    height: 128\ntrainer:\n  lr: 3.0e-4\n")
    cfg = load_config(str(path), ["rollout.n=16"])
    assert cfg.rollout.n == 16  # the override wins over the file
    assert cfg.rollout.sampling.height == 128 and cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.rollout.sampling.width == FlowRLConfig().rollout.sampling.width  # untouched default


def test_yaml_output_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "rollout.sampling.sde_window_size=2",
            "rollout.sampling.sde_window_range=[0,4]",
            "trainer.mixed_precision=no",
            "reward.name=null",
            "reward.components=[{name: ocr, weight: 2.0, options: {lang: en}}, {name: jpeg_compressibility}]",
        ],
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(str(path), []) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("rollout.nn=3", "rollout.nn", "rollout.n?"),
        ("trainer.lora.rnak=4", "trainer.lora.rank", "trainer.lora.rank?"),
        ("rollout.sampling.guidance=4.5", "rollout.sampling.guidance", "rollout.sampling.guidance_scale?"),
        ("rollot.n=3", "rollot", "rollout?"),
    ],
)
def test_unknown_key_names_it_and_suggests_the_closest(override, key, hint):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert key in str(error.value) and f"did you mean {hint}" in str(error.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  enable_batched_difusion: false\n")
    with pytest.raises(ValueError, match=r"rollout\.enable_batched_difusion.*rollout\.enable_batched_diffusion\?"):
        load_config(str(path), [])


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.n=abc", "rollout.n"),
        ("rollout.n=2.5", "rollout.n"),
        ("rollout.enable_batched_diffusion=2", "rollout.enable_batched_diffusion"),
        ("trainer.betas=[0.9,0.99,0.9]", "trainer.betas"),
        ("trainer.lr=fast", "trainer.lr"),
        ("rollout.sampling=3", "rollout.sampling"),
        ("trainer.lora.target_modules=to_q", "trainer.lora.target_modules"),
        ("rollout.sampling.sde_window=[1,x]", "rollout.sampling.sde_window.1"),
    ],
)
def test_wrong_type_names_key_and_value(override, key):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    message = str(error.value)
    assert key in message and override.split("=", 1)[1].strip("[]").split(",")[-1] in message


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.n=0", "rollout.n"),
        ("rollout.n=1", "rollout.n"),  # flow_grpo needs a group of at least two
        ("model.dtype=float64", "model.dtype"),
        ("model.device=gpu", "model.device"),
        ("algorithm.std_mode=batch", "algorithm.std_mode"),
        ("algorithm.old_log_prob=old", "algorithm.old_log_prob"),
        ("algorithm.train_timestep_fraction=0", "algorithm.train_timestep_fraction"),
        ("trainer.lr=-1e-4", "trainer.lr"),
        ("trainer.mixed_precision=fp8", "trainer.mixed_precision"),
        ("trainer.lora.init=xavier", "trainer.lora.init"),
        ("rollout.sampling.sde_type=ode", "rollout.sampling.sde_type"),
        ("rollout.sampling.height=65", "rollout.sampling.height"),
        ("rollout.sampling.seed=3", "rollout.sampling.seed"),
        ("data.train_path=prompts.csv", "data.train_path"),
        ("engine.max_batch_rows=0", "engine.max_batch_rows"),
        ("reward.components=[{name: ocr}]", "reward.name"),
    ],
)
def test_semantic_errors_name_the_field(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_reward_component_keys_are_checked():
    with pytest.raises(ValueError, match=r"reward\.components\.0\.wieght.*did you mean reward\.components\.0\.weight"):
        load_config(None, ["reward.name=null", "reward.components=[{name: ocr, wieght: 2}]"])
    cfg = load_config(None, ["reward.name=null", "reward.components=[{name: ocr}]"])
    assert cfg.reward.resolved_components() == [{"name": "ocr", "weight": 1.0, "options": {}, "optional": False}]


@pytest.mark.parametrize("override", ["rollout.n", "=3", "+rollout.n=3", "rollout..n=3"])
def test_malformed_override(override):
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, [override])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"), [])


def test_slices_are_independent_dataclasses():
    cfg = load_config(None, [])
    sections = {f.name for f in dataclasses.fields(cfg)}
    assert sections == {
        "model",
        "engine",
        "rollout",
        "algorithm",
        "trainer",
        "reward",
        "data",
        "logging",
        "distributed",
    }
    # A component validates its own slice without the root.
    assert cfg.rollout.validate() is cfg.rollout
    assert cfg.trainer.updates_per_step >= 1 and cfg.trainer.ema.validate() is cfg.trainer.ema


def test_cli_config_show_prints_resolved_yaml(capsys):
    from flowrl.cli import main

    assert main(["config", "show", "rollout.n=8", "rollout.sampling.guidance_scale=4.5"]) == 0
    out = capsys.readouterr().out
    assert "n: 8" in out
    shown = yaml.safe_load(out)
    assert shown["rollout"]["n"] == 8 and shown["rollout"]["sampling"]["guidance_scale"] == 4.5


def test_cli_config_show_reports_errors(capsys):
    from flowrl.cli import main

    assert main(["config", "show", "rollout.nn=8"]) == 2
    assert "rollout.nn" in capsys.readouterr().err


def test_docs_mention_every_key():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    missing = [key for key in _flatten(config_to_dict(FlowRLConfig())) if key.rsplit(".", 1)[-1] not in text]
    assert not missing, f"docs/config.md does not mention {missing}"


def _choice_fields(cls, prefix: str = ""):
    """(dotted key, choices) of every Literal-typed field under the dataclass cls."""
    from flowrl.config.sections import field_types, literal_choices

    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            yield from _choice_fields(tp, f"{prefix}{name}.")
        elif literal_choices(tp) is not None:
            yield f"{prefix}{name}", literal_choices(tp)


# Choices that load only with the settings they need (each refused without them: their own tests).
_CHOICE_NEEDS = {
    "rollout.sde_window_draw=progressive": ["rollout.sampling.sde_window_size=2"],
    "rollout.sampling.ode_solver=dpmpp_2m": ["rollout.sampling.sde_window_size=2"],
    "algorithm.policy_loss=grpo_guard": ["algorithm.old_log_prob=recompute"],
    "algorithm.policy_loss=dppo": ["algorithm.old_log_prob=recompute"],
    "algorithm.kl_type=velocity": ["algorithm.kl_beta=0.01"],
    "algorithm.advantage_aggregation=gdpo": [
        "reward.name=null",
        "reward.components=[{name: jpeg_compressibility}, {name: image_contrast}]",
    ],
}


def test_every_choice_field_rejects_other_values_naming_field_and_choices():
    fields = dict(_choice_fields(FlowRLConfig))
    assert {"model.dtype", "algorithm.std_mode", "trainer.lora.init", "rollout.sampling.sde_type"} <= set(fields)
    from flowrl.config.algorithm_rules import OWN_SETTINGS

    for key, choices in fields.items():
        # A setting of one algorithm alone is given with that algorithm.
        section = key.split(".")[1] if key.startswith("algorithm.") else None
        owner = [f"algorithm.name={OWN_SETTINGS[section][0]}"] if section in OWN_SETTINGS else []
        for choice in choices:  # every choice loads (None spelled as YAML's null)
            value = "null" if choice is None else choice
            assert load_config(None, [*owner, f"{key}={value}", *_CHOICE_NEEDS.get(f"{key}={value}", [])])
        listed = ", ".join(map(repr, choices))
        with pytest.raises(ValueError) as error:
            load_config(None, [*owner, f"{key}=bogus"])
        assert str(error.value) == f"{key}='bogus' is invalid: use one of {listed}"


def test_validate_checks_choices_of_a_section_built_in_code():
    from flowrl.config import AlgorithmConfig, LoraConfig

    with pytest.raises(ValueError, match=r"^algorithm\.zero_std_policy='never' is invalid: use one of 'keep', 'drop'$"):
        AlgorithmConfig(zero_std_policy="never").validate()
    with pytest.raises(ValueError, match=r"^trainer\.lora\.init='xavier' is invalid"):
        LoraConfig(init="xavier").validate()


def test_code_that_maps_a_choice_list_covers_exactly_its_choices():
    from typing import get_args

    from flowrl.config.sections import MixedPrecision
    from flowrl.models.base import MIXED_PRECISION_DTYPES

    assert tuple(MIXED_PRECISION_DTYPES) == get_args(MixedPrecision)


def test_sampling_params_and_config_stay_light():
    """SamplingParams is plain data (no torch); the config pulls in no torch, models, accel, engine,
    rollout or trainer."""
    import subprocess
    import sys

    code = (
        "import sys, flowrl.sampling_params; assert 'torch' not in sys.modules, 'torch'; "
        "import flowrl.config; assert 'torch' not in sys.modules, 'torch'; "
        "bad = [m for m in sys.modules if m.startswith(('flowrl.models', 'flowrl.accel', 'flowrl.engine', "
        "'flowrl.rollout', 'flowrl.trainer'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_override_of_a_whole_mapping_replaces_the_recipes_and_a_dotted_one_sets_one_key():
    """`reward.options={}` used to merge into the recipe's options and change nothing (the FLUX
    recipe's PickScore options could not be dropped); it replaces them now, as written."""
    from pathlib import Path

    from flowrl.config import load_config

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "flux_dev_pickscore_lora.yaml")
    options = load_config(recipe).reward.options
    assert len(options) > 1
    assert load_config(recipe, ["reward.options={}"]).reward.options == {}
    assert load_config(recipe, ["reward.options={scale: 2.0}"]).reward.options == {"scale": 2.0}
    name = next(iter(options))
    assert load_config(recipe, [f"reward.options.{name}=other"]).reward.options == {**options, name: "other"}
    # A later whole-mapping override replaces an earlier one; a later dotted one adds to it.
    assert load_config(recipe, ["reward.options={a: 1}", "reward.options.b=2"]).reward.options == {"a": 1, "b": 2}
    assert load_config(recipe, ["reward.options.b=2", "reward.options={a: 1}"]).reward.options == {"a": 1}


@pytest.mark.parametrize("key", sorted(__import__("flowrl.config.sections", fromlist=["x"]).REMOVED_KEYS))
def test_a_removed_key_is_refused_naming_it_and_why(key):
    """A config written for an older flowrl that still sets a removed key fails naming the key,
    why it went and the fix, instead of being accepted and ignored; a run's saved config (flowrl's
    own output) drops it."""
    from flowrl.config import config_from_dict
    from flowrl.config.sections import REMOVED_KEYS

    with pytest.raises(ValueError) as error:
        load_config(None, [f"{key}=1"])
    assert f"{key} was removed from flowrl ({REMOVED_KEYS[key]}); delete it" in str(error.value)
    section, name = key.split(".")
    assert config_from_dict({section: {name: 1}}, saved=True) == load_config(None, [])
    with pytest.raises(ValueError, match="was removed"):
        config_from_dict({section: {name: 1}})
