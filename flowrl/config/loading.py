"""Loading flowrl configs: defaults <- YAML file <- `key=value` overrides, with strict keys and
types (a `Literal` field takes only its choices), converted back to the plain dataclasses of
`flowrl.config.sections` and validated. Like the sections, it knows nothing about models or engines.

Layers merge key by key, except where an override names a free-form mapping field itself
(`reward.options={}`, `reward.options={model: m}`): its value replaces the mapping the earlier
layers built, so a recipe's options can be cleared or swapped; `reward.options.model=m` sets one
key of it and keeps the others.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from collections.abc import Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flowrl.config.sections import REMOVED_KEYS, FlowRLConfig, check_choice, field_types, literal_choices

# ---- Loading: defaults <- YAML file <- overrides; strict keys and types; back to dataclasses ----


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `1e-4` is a float (1.1 wants `1.0e-4`), and only
    true/false are booleans (1.1 also turns yes/no/on/off into bools, so
    `trainer.mixed_precision=no` would silently become False)."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> FlowRLConfig:
    """Defaults, then the YAML file at `path` (if any), then each `key=value` override, validated."""
    layers = [] if path is None else [(f"config file {path}", _read_yaml(path), None)]
    layers += [_override_layer(item) for item in overrides]
    return _build(layers)


def config_from_dict(data: dict, overrides: Sequence[str] = (), saved: bool = False) -> FlowRLConfig:
    """Like `load_config`, from an already parsed mapping. saved=True: a config flowrl wrote itself
    (a run's or a checkpoint's), whose keys that flowrl has removed since (REMOVED_KEYS) are
    dropped instead of refused: they named speed settings, not what the weights mean."""
    if saved:
        data = _without_removed_keys(data)
    return _build([("config", data, None)] + [_override_layer(item) for item in overrides])


def _without_removed_keys(data: dict, prefix: str = "") -> dict:
    if not isinstance(data, dict):
        return data
    return {
        key: _without_removed_keys(value, f"{prefix}{key}.")
        for key, value in data.items()
        if f"{prefix}{key}" not in REMOVED_KEYS
    }


def config_to_dict(cfg) -> dict:
    """Plain, JSON/YAML-ready dict of a config or any slice of it (tuples become lists)."""
    return _plain(dataclasses.asdict(cfg))


def config_to_yaml(cfg) -> str:
    """YAML that `load_config` reads back into an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_YamlLoader)
    except FileNotFoundError:
        raise ValueError(f"--config {path!r} does not exist; pass an existing YAML file (see recipes/)") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path} is not valid YAML: {error}") from None
    return {} if data is None else data


def _parse_override(item: str) -> dict:
    """`a.b.c=value` -> {"a": {"b": {"c": parsed value}}}, the value parsed as YAML."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or key.startswith(("+", "~")) or "" in key.split("."):
        raise ValueError(f"override {item!r} is not a dotted key=value pair; write e.g. rollout.n=16")
    try:
        value = yaml.load(raw, Loader=_YamlLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"override {item!r}: the value is not valid YAML ({error}); quote strings") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _override_layer(item: str) -> tuple[str, dict, tuple[str, dict] | None]:
    """(source, nested value, (dotted key, mapping) when it replaces a free-form mapping, else None)
    of one override."""
    data = _parse_override(item)
    key = item.partition("=")[0].strip()
    value = data
    for part in key.split("."):
        value = value[part]
    replacement = (key, value) if isinstance(value, dict) and _is_free_mapping(_annotation_at(key)) else None
    return f"override {item!r}", data, replacement


def _annotation_at(dotted_key: str):
    """The annotation of a dotted config key (None where no dataclass field is named)."""
    tp = FlowRLConfig
    for part in dotted_key.split("."):
        if not dataclasses.is_dataclass(tp) or part not in field_types(tp):
            return None
        tp = field_types(tp)[part]
    return tp


def _is_free_mapping(tp) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _build(layers: list[tuple[str, object, tuple[str, dict] | None]]) -> FlowRLConfig:
    """layers: (source, data, replacement), replacement as `_override_layer` returns it."""
    # Our own strict check first, of every layer: OmegaConf alone would accept `n: 2.0`-style
    # coercions (bool from 2, str from a list) and gives no dotted key for tuple-length errors.
    for source, data, _ in layers:
        _check_value(FlowRLConfig, data, "", source)
    merged = OmegaConf.structured(FlowRLConfig)
    for source, data, replacement in layers:
        try:
            merged = OmegaConf.merge(merged, data)
            if replacement is not None:
                OmegaConf.update(merged, *replacement, merge=False)
        except OmegaConfBaseException as error:  # a safety net; _check_value should catch all
            raise ValueError(f"{source}: {error.full_key}: {error.msg}") from None
    cfg = OmegaConf.to_object(merged)
    return cfg.validate()


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if arg is type(None) else _describe(arg) for arg in args)
    if origin is tuple:
        return f"a list of {len(args)} values like [{', '.join(_describe(a).split()[-1] for a in args)}]"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if tp is list or origin is list:
        return "a list"
    return "a mapping of keys to values"


def _default_at(dotted_key: str):
    node = FlowRLConfig()
    for part in dotted_key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return _plain(node)


def _wrong_type(source: str, key: str, value, tp):
    example = _default_at(key)
    hint = f", e.g. {key}={json.dumps(example)}" if example is not None else ""
    raise ValueError(f"{source}: {key}={value!r} has the wrong type; expected {_describe(tp)}{hint}")


def _check_value(tp, value, key: str, source: str) -> None:
    """Raise ValueError naming the dotted key when `value` does not fit the annotation `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(
                f"{source}: {key or 'the config'}={value!r} must be a mapping of keys "
                f"({', '.join(field_types(tp))}); write e.g. {key or 'rollout'}.<key>=<value>"
            )
        for name, item in value.items():
            full_key = f"{key}.{name}" if key else str(name)
            if full_key in REMOVED_KEYS:
                raise ValueError(
                    f"{source}: {full_key} was removed from flowrl ({REMOVED_KEYS[full_key]}); delete it from "
                    "the config (docs/config.md lists the removed keys)"
                )
            if name not in field_types(tp):
                close = difflib.get_close_matches(str(name), list(field_types(tp)), n=1)
                prefix = f"{key}." if key else ""
                fix = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(field_types(tp))}"
                raise ValueError(f"{source}: unknown key {full_key!r} (value {item!r}); {fix}")
            _check_value(field_types(tp)[name], item, full_key, source)
        return
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        members = [arg for arg in args if arg is not type(None)]
        if len(members) == 1 and value is not None:  # Optional[X]: X's own, more precise errors
            return _check_value(members[0], value, key, source)
        for member in members:
            try:
                return _check_value(member, value, key, source)
            except ValueError:
                pass
        _wrong_type(source, key, value, tp)
    choices = literal_choices(tp)
    if choices is not None:
        return check_choice(key, value, choices)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        # A number is a fine string (YAML reads `wandb_project: 2024` as an int).
        str: lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool),
    }
    if tp in ok:
        if not ok[tp](value):
            _wrong_type(source, key, value, tp)
    elif origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            _wrong_type(source, key, value, tp)
        for index, (member, item) in enumerate(zip(args, value)):
            _check_value(member, item, f"{key}.{index}", source)
    elif tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            _wrong_type(source, key, value, tp)
        for index, item in enumerate(value):
            if args:
                _check_value(args[0], item, f"{key}.{index}", source)
    elif tp is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
            _wrong_type(source, key, value, tp)
        for name, item in value.items():
            if len(args) == 2:
                _check_value(args[1], item, f"{key}.{name}", source)
