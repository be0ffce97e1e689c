"""Weight updates of a served model: every check before anything changes, then an in-place copy.

`parse_update_query` reads POST /v1/weights's query (kind, version, sha256). `prepare_update`
checks a body (flowrl.server.wire's weights format) against the live transformer: the file's
sha256, that the body is for the checkpoint's module this server trains-in (`flowrl.component`:
Wan2.2-A14B's experts share names and shapes), then that the tensor names are exactly the
model's LoRA (or full) parameter names, with every shape and dtype equal, every value finite,
and, for a LoRA, its settings; any mismatch is a BadRequest naming it, and the model is
untouched. `apply_update` then copies the tensors in (adding the LoRA first when the server held
none); the caller runs it while no sample is in flight (flowrl.server.admission).
`live_weights` gives the tensors a checksum of the served weights covers.

It knows transformers, peft LoRA and the weights format, nothing about HTTP or scheduling.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flowrl.models.lora import apply_trainable, has_lora
from flowrl.models.wan import EXPERT_COMPONENTS
from flowrl.server import wire
from flowrl.server.score_request import BadRequest

KINDS = ("lora", "full")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LORA_KEYS = ("rank", "alpha", "target_modules", "dropout")


@dataclass
class PreparedUpdate:
    kind: str
    version: int
    sha256: str
    state: dict[str, torch.Tensor]
    lora_to_add: object | None = None  # a flowrl LoraConfig when the server holds no LoRA yet


def parse_update_query(query: Mapping[str, str]) -> tuple[str, int, str]:
    """(kind, version, sha256) of POST /v1/weights?kind=...&version=...&sha256=..."""
    unknown = sorted(set(query) - {"kind", "version", "sha256"})
    if unknown:
        raise BadRequest(f"query parameter {unknown[0]!r} is unknown; use kind, version, sha256", param=unknown[0])
    kind = query.get("kind")
    if kind not in KINDS:
        raise BadRequest(f"kind={kind!r} must be one of {KINDS}", param="kind")
    version = query.get("version", "")
    if not version.isdigit() or len(version) > 18:
        raise BadRequest(f"version={version!r} must be an integer >= 0 (the new policy version)", param="version")
    sha256 = query.get("sha256", "").lower()
    if not _SHA256.fullmatch(sha256):
        raise BadRequest(
            f"sha256={query.get('sha256')!r} must be the 64 hex digits of the body's sha256 (sha256sum FILE)",
            param="sha256",
        )
    return kind, int(version), sha256


def _lora_settings(metadata: dict[str, str]):
    """The LoraConfig a body's `flowrl.lora` metadata describes, or None without one."""
    from flowrl.config.sections import LoraConfig

    text = metadata.get("flowrl.lora")
    if text is None:
        return None
    try:
        settings = json.loads(text)
        if not isinstance(settings, dict) or sorted(settings) != sorted(_LORA_KEYS):
            raise ValueError(f"it must be a JSON object of exactly {list(_LORA_KEYS)}")
        return LoraConfig(enabled=True, init="default", **settings).validate()
    except (ValueError, TypeError) as error:
        raise BadRequest(f"the body's flowrl.lora metadata is invalid: {error}", param="flowrl.lora") from None


def _check_component(given: str, served: str) -> None:
    """Weights of one module of the checkpoint must go into that module: Wan2.2-A14B's two experts
    have the same parameter names and shapes, so nothing else would tell them apart."""
    if given == served:
        return
    expert = next((name for name, folder in EXPERT_COMPONENTS.items() if folder == given), None)
    fix = f"model.trained_expert={expert}" if expert else "the module the trainer trains"
    raise BadRequest(
        f"the weights are for the checkpoint's {given!r} and this server's trained module is its {served!r}; "
        f"start the server with {fix} (the training run's setting)",
        409,
        param="flowrl.component",
    )


def _live_lora_settings(transformer) -> tuple:
    config = transformer.peft_config["default"]
    return (config.r, float(config.lora_alpha), sorted(config.target_modules), float(config.lora_dropout))


def _predicted_lora(transformer, lora) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of the LoRA parameters `apply_trainable(transformer, lora)` would add
    (peft's matching: a Linear whose name is a target or ends with "." + target)."""
    expected = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(
            name == t or name.endswith("." + t) for t in lora.target_modules
        ):
            expected[f"{name}.lora_A.default.weight"] = ((lora.rank, module.in_features), torch.float32)
            expected[f"{name}.lora_B.default.weight"] = ((module.out_features, lora.rank), torch.float32)
    return expected


def live_weights(transformer) -> tuple[str, dict[str, torch.Tensor]]:
    """("lora", the LoRA parameters) when the transformer holds a LoRA, else ("full", every parameter)."""
    if has_lora(transformer):
        return "lora", {name: p for name, p in transformer.named_parameters() if ".lora_" in name}
    return "full", dict(transformer.named_parameters())


def _expected(kind: str, transformer, lora, is_compiled: bool):
    """(name -> (shape, dtype) the body must hold, the LoRA to add first or None)."""
    if kind == "full":
        if has_lora(transformer):
            raise BadRequest(
                "kind=full: this server holds a LoRA, so full weights cannot replace its model; push the LoRA "
                "(kind=lora), or serve the base model without one",
                409,
                param="kind",
            )
        return {name: (tuple(p.shape), p.dtype) for name, p in transformer.named_parameters()}, None
    if has_lora(transformer):
        if lora is not None:
            given = (lora.rank, float(lora.alpha), sorted(lora.target_modules), float(lora.dropout))
            if given != _live_lora_settings(transformer):
                raise BadRequest(
                    f"the LoRA settings (rank, alpha, target_modules, dropout) {given} differ from the served "
                    f"LoRA's {_live_lora_settings(transformer)}; restart the server to change them",
                    422,
                    param="flowrl.lora",
                )
        _, live = live_weights(transformer)
        return {name: (tuple(p.shape), p.dtype) for name, p in live.items()}, None
    if lora is None:
        raise BadRequest(
            "kind=lora: this server holds no LoRA and the body names no LoRA settings; write the body with "
            "wire.encode_weights(state, lora={rank, alpha, target_modules, dropout})",
            409,
            param="flowrl.lora",
        )
    if is_compiled:
        raise BadRequest(
            "kind=lora: this server's model is compiled without a LoRA, and compiled graphs cannot take a new one; "
            "start the server with its LoRA (--lora, --checkpoint or --run)",
            409,
            param="kind",
        )
    return _predicted_lora(transformer, lora), lora


def prepare_update(
    body: bytes,
    kind: str,
    version: int,
    sha256: str,
    transformer,
    is_compiled: bool,
    component: str = wire.WEIGHTS_COMPONENT,
) -> PreparedUpdate:
    """The checked update (module docstring); BadRequest naming the first mismatch. `component`:
    the checkpoint's module `transformer` is (the served adapter's trained_component)."""
    actual = wire.file_sha256(body)
    if actual != sha256:
        raise BadRequest(
            f"sha256 mismatch: the body's sha256 is {actual}, the request says {sha256}; the upload is damaged "
            "or the checksum is of another file",
            422,
            param="sha256",
        )
    try:
        metadata = wire.read_metadata(body, "the weights body")
        state = wire.load_tensors(body, "the weights body")
    except ValueError as error:
        raise BadRequest(str(error), param="body") from None
    _check_component(metadata.get("flowrl.component", wire.WEIGHTS_COMPONENT), component)
    expected, lora_to_add = _expected(kind, transformer, _lora_settings(metadata), is_compiled)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise BadRequest(
            f"kind={kind}: the body's tensor names do not match the model's {kind} parameters ({len(missing)} missing, "
            f"e.g. {missing[:3]}; {len(extra)} unexpected, e.g. {extra[:3]}); push weights of this base model "
            "and LoRA settings",
            422,
            param="body",
        )
    for name, tensor in state.items():
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise BadRequest(
                f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the model's is {dtype} {shape}; push "
                "weights of this base model and LoRA settings, in the model's dtypes",
                422,
                param="body",
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise BadRequest(
                f"tensor {name!r} holds {bad} non-finite value(s) (NaN or infinity), which would make every "
                "sample fail; the served weights are unchanged: push finite weights (a diverged update?)",
                422,
                param="body",
            )
    return PreparedUpdate(kind, version, sha256, state, lora_to_add)


def apply_update(update: PreparedUpdate, transformer) -> None:
    """Copy the checked tensors in; call only while no forward runs."""
    if update.lora_to_add is not None:
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep the global RNG as it was
            apply_trainable(transformer, update.lora_to_add)
    params = dict(transformer.named_parameters())
    assert set(update.state) <= set(params), "prepare_update checked the names against this model"
    with torch.no_grad():
        for name, tensor in update.state.items():
            params[name].copy_(tensor)
