"""Trained weights: where they are, and how they go into a loaded model (used by eval and generate).

A `WeightSource` is one set of weights to sample with:
- `base`: the model as loaded (a LoRA injected for other sources is switched off);
- `lora`: a diffusers-format LoRA folder (`pytorch_lora_weights.safetensors`, the adapter config
  in its metadata): a run's `final/lora` or `checkpoints/step_N/lora`, or one saved by diffusers;
- `transformer`: a transformer model folder (config.json + safetensors shards), e.g. `final/transformer`
  (`final/transformer_2` after training Wan2.2-A14B's low expert);
- `checkpoint`: a training checkpoint (`trainable.safetensors`, or with `ema` its
  `ema.safetensors`, which holds the same names; a sharded full fine-tune's `sharded/`, gathered
  into whole tensors in this process), read with the LoRA settings of its state.json.
A run directory (`trainer.output_dir`) gives every complete checkpoint in step order, then its
`final/` when that is newer. Sources found inside a run carry the run's saved config, so callers
can sample with the run's own validation settings.

`WeightLoader(adapter)` puts sources into the adapter's transformer in place, as the trainer held
them (of a two-expert model, the expert model.trained_expert names, which a run's saved config
gives the adapter): a LoRA becomes the trainer's float32 adapter (flowrl.models.lora.apply_trainable, the same
forward), so sampling reproduces the run's validation images; full weights are copied by name.
Full weights overwrite the base, so the base must be sampled first.

It knows the checkpoint and LoRA file formats, nothing about sampling or scoring.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from flowrl.distributed.sharded_checkpoint import check_sharded_folder, is_sharded_checkpoint, read_full_tensors
from flowrl.models.lora import apply_trainable, has_lora
from flowrl.run.export import read_run_info

LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name
EMA_WEIGHTS_FILE = "ema.safetensors"
TRAINABLE_WEIGHTS_FILE = "trainable.safetensors"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def check_model_folder(path: str | Path, flag: str = "--model") -> Path:
    """The local diffusers pipeline folder `path`, or a ValueError naming `flag`: one message for a
    missing path, one for what looks like a hub id, one for a folder that is not a pipeline."""
    from flowrl.models.registry import check_model_files, read_model_family

    text = str(path)
    folder = Path(text).expanduser()
    if not folder.exists():
        if _HUB_ID.fullmatch(text):
            raise ValueError(
                f"{flag} {text!r} is not a local folder; it looks like a Hugging Face hub id, and flowrl loads "
                f"local diffusers folders: download it first with `hf download {text} --local-dir DIR`, then "
                f"pass {flag} DIR"
            )
        raise ValueError(f"{flag} {text!r} not found; pass a local diffusers pipeline folder (with model_index.json)")
    read_model_family(folder, key=flag)  # a pipeline of a supported family, or a ValueError naming the flag
    check_model_files(folder, key=flag)  # a component missing or truncated
    return folder


@dataclass
class WeightSource:
    """One set of weights (module docstring). `label` names it in reports and file names;
    `config` is the training run's saved config when the source lies in a run."""

    label: str
    kind: Literal["base", "lora", "transformer", "checkpoint"]
    path: Path | None = None
    step: int | None = None
    ema: bool = False
    config: dict | None = None


BASE = WeightSource("base", "base", step=0)


def _existing_folder(path: str | Path, flag: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r} not found; pass an existing folder")
    return folder


def _run_info_of(folder: Path) -> tuple[int | None, dict | None]:
    """(step, config) of the run a LoRA or transformer folder sits in (final/X or step_N/X)."""
    info = read_run_info(folder.parent)
    if info is not None:
        return info.get("step"), info.get("config")
    state = folder.parent / "state.json"
    if state.is_file():
        saved = json.loads(state.read_text())
        return saved.get("step"), saved.get("config")
    return None, None


def lora_source(path: str | Path, label: str = "lora", flag: str = "--lora") -> WeightSource:
    folder = _existing_folder(path, flag)
    if not (folder / LORA_WEIGHTS_FILE).is_file():
        raise ValueError(
            f"{flag} {str(path)!r} holds no {LORA_WEIGHTS_FILE}; pass a diffusers LoRA folder such as a run's "
            "final/lora or checkpoints/step_N/lora"
        )
    step, config = _run_info_of(folder)
    return WeightSource(label, "lora", folder, step, config=config)


def transformer_source(path: str | Path, label: str = "transformer", flag: str = "--transformer") -> WeightSource:
    folder = _existing_folder(path, flag)
    if not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        raise ValueError(
            f"{flag} {str(path)!r} is not a transformer model folder (config.json and .safetensors weights); "
            "pass e.g. a run's final/transformer"
        )
    step, config = _run_info_of(folder)
    return WeightSource(label, "transformer", folder, step, config=config)


def checkpoint_source(path: str | Path, ema: bool = False, flag: str = "--checkpoint") -> WeightSource:
    folder = _existing_folder(path, flag)
    if not (folder / "state.json").is_file():
        raise ValueError(
            f"{flag} {str(path)!r} is not a complete training checkpoint (no state.json); pass a folder like "
            "<output_dir>/checkpoints/step_000010, or the run itself with --run"
        )
    weights = folder / (EMA_WEIGHTS_FILE if ema else TRAINABLE_WEIGHTS_FILE)
    if is_sharded_checkpoint(folder):  # sharded full fine-tuning: gathered from its shards on load
        try:
            saved = check_sharded_folder(folder)
        except ValueError as error:
            raise ValueError(f"{flag} {str(path)!r}: {error}") from None
        if ema and not any(name.startswith("ema.") for name in saved):
            raise ValueError(
                f"{flag} {str(path)!r} holds no EMA weights in sharded/; train with EMA on, or leave out --ema"
            )
    elif not weights.is_file():
        fix = "train with EMA on, or leave out --ema" if ema else "the checkpoint is damaged; use another step"
        raise ValueError(f"{flag} {str(path)!r} has no {weights.name}; {fix}")
    saved = json.loads((folder / "state.json").read_text())
    label = folder.name + ("_ema" if ema else "")
    return WeightSource(label, "checkpoint", folder, saved.get("step"), ema, saved.get("config"))


def run_sources(run_dir: str | Path, ema: bool = False, flag: str = "--run") -> list[WeightSource]:
    """Every complete checkpoint of a run in step order, then final/ when it is newer than the
    last checkpoint (with `ema`, checkpoints only: final/ holds the trained weights)."""
    run = _existing_folder(run_dir, flag)
    root = run / "checkpoints"
    steps = sorted(
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()
    )
    sources = [checkpoint_source(path, ema, flag) for _, path in steps]
    final = run / "final"
    info = read_run_info(final)
    if not ema and final.is_dir() and (info is None or info.get("step") not in {step for step, _ in steps}):
        source = lora_source(final / "lora", "final") if (final / "lora").is_dir() else None
        trained = (info or {}).get("trained_component", "transformer")  # transformer_2: A14B's low expert
        if source is None and (final / trained).is_dir():
            source = transformer_source(final / trained, "final")
        if source is not None:
            sources.append(source)
    if not sources:
        raise ValueError(
            f"{flag} {str(run_dir)!r} holds no checkpoints/step_N with state.json{'' if ema else ' and no final/'}; "
            "pass the trainer.output_dir of a run that saved weights"
        )
    return sources


# --- loading --------------------------------------------------------------------------------------


def _read_lora_folder(folder: Path):
    """(state dict in the trainer's parameter names, flowrl LoraConfig) of a diffusers LoRA folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from flowrl.config.sections import LoraConfig

    file = folder / LORA_WEIGHTS_FILE
    with safe_open(str(file), "pt") as handle:
        metadata = handle.metadata() or {}
    raw = json.loads(metadata.get("lora_adapter_metadata") or "{}")
    settings = {key.removeprefix("transformer."): value for key, value in raw.items() if key.startswith("transformer.")}
    state = {}
    for key, tensor in load_file(str(file)).items():
        if not key.startswith("transformer.") or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(
                f"{file} holds {key!r}; flowrl loads LoRA weights of the transformer only (lora_A / lora_B)"
            )
        module, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        state[f"{module}.lora_{part.replace('.weight', '.default.weight')}"] = tensor
    modules = sorted({key.rpartition(".lora_")[0] for key in state})
    if not modules:
        raise ValueError(f"{file} holds no LoRA weights; pass the folder of a saved LoRA")
    rank = int(settings.get("r") or state[f"{modules[0]}.lora_A.default.weight"].shape[0])
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "use_dora", "use_rslora") if settings.get(k)]
    if unsupported:
        raise ValueError(f"{file}: LoRA settings {unsupported} are not supported; flowrl loads plain LoRA adapters")
    lora_config = LoraConfig(
        enabled=True,
        rank=rank,
        alpha=float(settings.get("lora_alpha") or rank),  # no metadata: diffusers' default, a scale of 1
        target_modules=sorted(settings.get("target_modules") or modules),
        dropout=float(settings.get("lora_dropout") or 0.0),
    )
    return state, lora_config


def _checkpoint_lora_config(source: WeightSource):
    """The checkpoint's trainer.lora as a LoraConfig (None: it trained the full transformer)."""
    from flowrl.config.sections import LoraConfig

    try:
        lora = LoraConfig(**(source.config or {})["trainer"]["lora"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"{source.path}/state.json has no usable trainer.lora settings ({error})") from None
    return lora if lora.enabled else None


def _lora_key(lora_config) -> tuple:
    return (lora_config.rank, lora_config.alpha, tuple(sorted(lora_config.target_modules)), lora_config.dropout)


class WeightLoader:
    """Loads WeightSources into one adapter's transformer in place (module docstring)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.transformer = adapter.transformer
        self._lora_key: tuple | None = None
        self._holds_full_weights = False

    def prepare(self, sources: list[WeightSource]) -> None:
        """Inject the LoRA the sources need before anything compiles the model (compiled blocks
        trace the modules they hold)."""
        for source in sources:
            if source.kind == "lora":
                self._ensure_lora(_read_lora_folder(source.path)[1], source)
            elif source.kind == "checkpoint" and (lora := _checkpoint_lora_config(source)) is not None:
                self._ensure_lora(lora, source)

    def _ensure_lora(self, lora_config, source: WeightSource) -> None:
        if self._lora_key is None:
            if self._holds_full_weights:
                raise ValueError(f"{source.label}: a LoRA cannot go on top of full weights loaded before it")
            with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep the caller's RNG
                apply_trainable(self.transformer, lora_config)
            self._lora_key = _lora_key(lora_config)
        elif self._lora_key != _lora_key(lora_config):
            raise ValueError(
                f"{source.label} ({source.path}) has LoRA settings {_lora_key(lora_config)} (rank, alpha, targets, "
                f"dropout), the LoRA loaded before {self._lora_key}; evaluate them in separate runs"
            )

    def load(self, source: WeightSource) -> None:
        """Make the transformer compute with `source`'s weights."""
        if source.kind == "base":
            assert not self._holds_full_weights, "the base must be sampled before full weights overwrite it"
            if has_lora(self.transformer):
                self.transformer.disable_adapters()
            return
        if source.kind == "lora":
            state, lora_config = _read_lora_folder(source.path)
        elif source.kind == "checkpoint":
            from safetensors.torch import load_file

            if is_sharded_checkpoint(source.path):  # every rank's chunks, gathered here
                state = read_full_tensors(source.path, "ema" if source.ema else "model")
            else:
                state = load_file(str(source.path / (EMA_WEIGHTS_FILE if source.ema else TRAINABLE_WEIGHTS_FILE)))
            lora_config = _checkpoint_lora_config(source)
        else:
            state, lora_config = None, None
        if lora_config is not None:
            self._ensure_lora(lora_config, source)
            self.transformer.enable_adapters()
            lora_names = {name for name, _ in self.transformer.named_parameters() if ".lora_" in name}
            self._copy(state, lora_names, source)
            return
        if has_lora(self.transformer):
            raise ValueError(f"{source.label}: full weights cannot replace a model that holds a LoRA loaded before")
        if source.kind == "transformer":  # shard by shard: one shard in memory at a time
            from safetensors.torch import load_file

            names = set(self.transformer.state_dict())  # a saved model holds its buffers too
            loaded: set[str] = set()
            for file in sorted(source.path.glob("*.safetensors")):
                shard = load_file(str(file))
                self._copy(shard, names, source, partial=True)
                loaded |= set(shard)
            self._check_names(loaded, names, source)
        else:  # a full-fine-tuning checkpoint: every parameter, by name
            self._copy(state, {name for name, _ in self.transformer.named_parameters()}, source)
        self._holds_full_weights = True

    def _copy(self, state: dict, expected: set[str], source: WeightSource, partial: bool = False) -> None:
        """Copy `state` into the transformer; its names must be `expected` (with `partial`, a
        subset of it: one shard of several)."""
        if partial and not set(state) <= expected:
            raise self._mismatch(set(), sorted(set(state) - expected), source)
        if not partial:
            self._check_names(set(state), expected, source)
        try:
            with torch.no_grad():
                self.transformer.load_state_dict(state, strict=False)
        except RuntimeError as error:  # shape mismatches
            raise ValueError(f"{source.label} ({source.path}) does not fit this model: {error}") from None

    def _check_names(self, found: set[str], expected: set[str], source: WeightSource) -> None:
        if found != expected:
            raise self._mismatch(sorted(expected - found), sorted(found - expected), source)

    @staticmethod
    def _mismatch(missing: list[str], extra: list[str], source: WeightSource) -> ValueError:
        return ValueError(
            f"{source.label} ({source.path}) does not match this model's weights (missing {missing[:5]}, "
            f"unexpected {extra[:5]}); pass the base model the weights were trained from with --model"
        )
