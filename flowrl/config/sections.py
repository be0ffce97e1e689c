"""flowrl configuration sections: one dataclass per component, each with `validate()`.

`flowrl.config.load_config(path, overrides)` (loading.py) merges, in order, the defaults below, a YAML file and
`key=value` overrides (`rollout.n=16 rollout.sampling.guidance_scale=4.5`), checks every key and
type strictly, converts back to plain dataclasses (real `SamplingParams`, tuples stay tuples) and
runs `validate()`. Each component receives only its own slice (`cfg.rollout`, `cfg.engine`, ...).

Defaults are tuned for the embedded tiny CPU run (64x64 images, few steps); recipes override them.
This module knows nothing about models, engines or trainers: it only describes and checks settings.

Every choice list is a `Literal` type on its field, its one home: `check_choices` (run by each
section's `validate()`, and by the loader on every file and override value) rejects any other
value, naming the field and the choices. `check_finite` (run first by the root's `validate()`)
rejects NaN and infinity in every float of every section. Code that needs a list as a tuple takes
`typing.get_args` of the type (`StdMode`, `MixedPrecision`, `OldLogProbSource`, and
`flowrl.sampling_params.SdeType`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from flowrl.sampling_params import MAX_SEED, SamplingParams

# Choice lists that code outside this module needs too.
StdMode = Literal["global", "group"]
OldLogProbSource = Literal["rollout", "recompute"]
MixedPrecision = Literal["no", "bf16", "fp16"]
GradientCheckpointing = bool | Literal["auto"]
ScoringWorkers = int | Literal["auto"]

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
REWARD_COMPONENT_KEYS = ("name", "weight", "options", "optional", "label")


def _fail(key: str, value, fix: str):
    raise ValueError(f"{key}={value!r} is invalid: {fix}")


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict:
    """Field name -> resolved annotation of a config dataclass."""
    return typing.get_type_hints(cls)


def literal_choices(tp) -> tuple | None:
    """The values a `Literal[...]` annotation allows; None for any other annotation."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def check_choice(key: str, value, choices: tuple) -> None:
    if value not in choices:
        _fail(key, value, f"use one of {', '.join(map(repr, choices))}")


def check_choices(section, prefix: str) -> None:
    """Every `Literal`-typed field of the dataclass `section` holds one of its choices."""
    for name, tp in field_types(type(section)).items():
        choices = literal_choices(tp)
        if choices is not None:
            check_choice(f"{prefix}.{name}", getattr(section, name), choices)


def _check_min(key: str, value, minimum, strict: bool = False) -> None:
    # Written as "not above" so that NaN, which compares False with everything, fails too.
    if value is not None and not (value > minimum if strict else value >= minimum):
        _fail(key, value, f"must be {'>' if strict else '>='} {minimum}")


def check_finite(node, key: str = "") -> None:
    """Every float anywhere in `node` (a config dataclass, with its nested dataclasses, tuples,
    lists and mappings) is finite: NaN or infinity is never a meaningful setting (a NaN guidance
    scale would silently turn CFG off, a NaN learning rate would train on garbage)."""
    if dataclasses.is_dataclass(node):
        items = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        if isinstance(node, float) and not math.isfinite(node):
            _fail(key, node, "must be a finite number (not NaN or infinity)")
        return
    for name, value in items:
        check_finite(value, f"{key}.{name}" if key else str(name))


@dataclass
class ModelConfig:
    """Which checkpoint to load and how.

    path: local diffusers folder (written by `save_pretrained` or `flowrl make-tiny`), or
        `random:NAME`: random weights at a published architecture (flowrl.models.random_weights;
        speed and memory runs only). None means the embedded tiny SD3 model, which the trainer
        builds offline on first use.
    family: "auto" reads model_index.json; or force "sd3" / "qwen_image" / "flux" / "z_image".
    dtype: dtype of the model weights ("float32" on CPU; "bfloat16" is usual on GPU).
    device: "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N".
    max_sequence_length: the prompt's text length in tokens (SD3: T5's, after CLIP's 77; FLUX: T5's;
        Qwen-Image and Z-Image: the longest prompt, shorter ones stay unpadded). None: the family's
        default (SD3 256, FLUX 512 as FluxPipeline, Qwen-Image 1024, Z-Image 512); the pipelines
        allow up to 512 (SD3, FLUX, Z-Image) and 1024 (Qwen-Image).
    """

    path: str | None = None
    family: Literal["auto", "sd3", "qwen_image", "flux", "z_image"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    max_sequence_length: int | None = None

    def validate(self) -> "ModelConfig":
        check_choices(self, "model")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            _fail("model.device", self.device, "use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_min("model.max_sequence_length", self.max_sequence_length, 1)
        return self

    def adapter_options(self) -> dict:
        """Keyword options of the family's adapter (`flowrl.models.registry.load_adapter`): the
        settings given here, the family's defaults for those left at None."""
        if self.max_sequence_length is None:
            return {}
        return {"max_sequence_length": self.max_sequence_length}

    def resolve_device(self) -> str:
        """The concrete device string ("auto" becomes "cuda" when a GPU is visible, else "cpu")."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


# torch.compile backends and compile roundings of `flowrl.accel.compile_adapter` (the engine's
# `compile` and `compile_rounding`): the one list of each, which flowrl.accel reads.
CompileBackend = Literal["inductor", "aot_eager", "eager"]
CompileRounding = Literal["eager", "fused"]
# Where the engine keeps prompt encodings (flowrl.engine.prompt_cache): host memory or the device.
PromptCacheDevice = Literal["host", "device"]


@dataclass
class EngineConfig:
    """Rollout engine limits.

    max_batch_rows: most transformer rows per forward (a CFG sample counts two rows).
    decode_chunk_size: most samples VAE-decoded at once (bounds decode memory).
    compile: regional torch.compile of the transformer blocks (and SD3's VAE decoder) with the
        fast paths of flowrl.accel (fused kernels, LoRA fold, Qwen-Image's block fast path).
    compile_rounding: where compiled kernels round bf16 intermediates: "eager" (where eager
        PyTorch does, so the trainer's grad graph stays close to the rollout's graph) or "fused"
        (only where kernels write); where the trainer's log-prob values come from does not
        depend on it (flowrl.trainer.update.Scoring); see flowrl.accel.regional_compile.
    prompt_cache_mb: MiB of prompt encodings kept for reuse (least recently used evicted first;
        0 disables the cache). prompt_cache_device: "host" (pinned host memory on a GPU machine,
        copied to the device per request) or "device" (no copy, costs device memory).
    """

    max_batch_rows: int = 32
    decode_chunk_size: int = 16
    compile: bool = False
    compile_rounding: CompileRounding = "eager"
    prompt_cache_mb: int = 1024
    prompt_cache_device: PromptCacheDevice = "host"

    def validate(self) -> "EngineConfig":
        for name in ("max_batch_rows", "decode_chunk_size"):
            _check_min(f"engine.{name}", getattr(self, name), 1)
        _check_min("engine.prompt_cache_mb", self.prompt_cache_mb, 0)
        check_choices(self, "engine")
        if self.compile_rounding != "eager" and not self.compile:
            raise ValueError(
                f"engine.compile_rounding={self.compile_rounding!r} takes effect only with "
                "engine.compile=true; set engine.compile=true or leave compile_rounding at 'eager'"
            )
        return self


def _default_sampling() -> SamplingParams:
    return SamplingParams(height=64, width=64, num_inference_steps=6, guidance_scale=1.0, noise_level=0.7)


def _default_val_sampling() -> SamplingParams:
    return _default_sampling().replace(noise_level=0.0, logprobs=False)


@dataclass
class RolloutConfig:
    """How dataset rows become rollouts (the agent loop's slice).

    n: samples per prompt (the group size of group-relative advantages). Rows are repeated
        interleaved: p0 x n, then p1 x n, ...
    enable_batched_diffusion: send each group of n consecutive rows as ONE
        `engine.generate_batched(prompt, n, sampling)` call (one prompt encoding, samples admitted
        together). Taken only when provably safe, i.e. all of: this flag is on; the engine supports
        batched generation; n > 1; len(batch) % n == 0; and within every group agent_name,
        raw_prompt, negative_prompt and sampling settings are identical. Otherwise (or with the
        flag off) every row is sent as its own single `generate` request, all in flight at once
        (the engine still batches them into shared forwards), with identical results and the same
        row layout; the agent loop logs why it fell back.
    seed: base seed; row i of a rollout batch gets a seed derived from it and the global row index,
        so reruns are identical. None: fresh randomness per row. (`sampling.seed` must stay None:
        per-row seeds always come from here.)
    val_seed: the base seed of validation rollouts, fixed so validation images are comparable
        across steps.
    sampling: SamplingParams of training rollouts (SDE, log-probs on).
    val_sampling: SamplingParams of validation rollouts (ODE: noise_level 0, no log-probs).
    merge_lora: training rollouts compute each adapted projection with the merged weight
        W + s B A, stochastically rounded to the model's dtype and made once per rollout (with
        engine.compile, in one compiled kernel per layer), instead of the base weight plus the
        low-rank term (flowrl.trainer.lora_merge): faster, at one more copy of the adapted
        weights in device memory while the rollout runs, sampling a policy within rounding noise
        of the trained one. Needs a LoRA adapter, algorithm.old_log_prob=recompute and the
        trainer's own engine. Validation and `flowrl eval` sample the adapter itself.

    Decoupled training (docs/serving.md): training rollouts run on rollout servers instead of the
    trainer's own engine (validation stays in the trainer's process, with its weights).
    servers: URLs of `flowrl serve` replicas started by the user (e.g. http://10.0.0.2:8000), all
        serving the trainer's model; empty: none.
    num_replicas: `flowrl serve` processes the trainer starts itself (on 127.0.0.1, model.path)
        and stops on exit; 0: none. Give either servers or num_replicas, not both.
    replica_devices: the device of each started replica (one entry per replica, e.g.
        [cuda:1, cuda:2]); empty: every replica on model.device.
    request_timeout_s: how long a rollout request may take on a server (queueing included)
        before the replica counts as down.
    max_replica_failures: a replica down this many times in a row is dropped for the rest of the
        run (its requests go to the others; with none left the step fails).
    """

    n: int = 4
    enable_batched_diffusion: bool = True
    seed: int | None = 42
    val_seed: int = 0
    sampling: SamplingParams = field(default_factory=_default_sampling)
    val_sampling: SamplingParams = field(default_factory=_default_val_sampling)
    merge_lora: bool = False
    servers: list[str] = field(default_factory=list)
    num_replicas: int = 0
    replica_devices: list[str] = field(default_factory=list)
    request_timeout_s: float = 600.0
    max_replica_failures: int = 2

    @property
    def is_decoupled(self) -> bool:
        """Whether training rollouts run on rollout servers (rollout.servers or rollout.num_replicas)."""
        return bool(self.servers) or self.num_replicas > 0

    def validate(self) -> "RolloutConfig":
        _check_min("rollout.n", self.n, 1)
        self._validate_replicas()
        for name in ("sampling", "val_sampling"):
            params = getattr(self, name)
            try:
                # Every supported family (SD3, Qwen-Image, FLUX, Z-Image) needs sides that are multiples of 16;
                # checking here fails before any model is loaded.
                params.validate(size_multiple=16)
            except ValueError as error:
                raise ValueError(str(error).replace("SamplingParams.", f"rollout.{name}.")) from None
            if params.seed is not None:
                _fail(
                    f"rollout.{name}.seed",
                    params.seed,
                    "per-row seeds derive from rollout.seed / rollout.val_seed; set those instead "
                    f"and leave rollout.{name}.seed=null",
                )
        return self

    def _validate_replicas(self) -> None:
        _check_min("rollout.num_replicas", self.num_replicas, 0)
        _check_min("rollout.request_timeout_s", self.request_timeout_s, 0.0, strict=True)
        _check_min("rollout.max_replica_failures", self.max_replica_failures, 1)
        for index, url in enumerate(self.servers):
            if not isinstance(url, str) or not re.fullmatch(r"https?://[^/\s]+/?", url):
                _fail(f"rollout.servers.{index}", url, "give a server's base URL, e.g. http://127.0.0.1:8000")
        if self.servers and self.num_replicas:
            _fail(
                "rollout.num_replicas",
                self.num_replicas,
                "rollout.servers is set too; use the servers you started (rollout.servers) or let flowrl "
                "start replicas (rollout.num_replicas), not both",
            )
        if self.replica_devices and len(self.replica_devices) != self.num_replicas:
            _fail(
                "rollout.replica_devices",
                self.replica_devices,
                f"give one device per started replica (rollout.num_replicas={self.num_replicas}), or leave it "
                "empty to start every replica on model.device",
            )
        for index, device in enumerate(self.replica_devices):
            if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
                _fail(f"rollout.replica_devices.{index}", device, "use 'cpu', 'cuda' or 'cuda:N'")


@dataclass
class AlgorithmConfig:
    """FlowGRPO objective: group-relative advantages and the clipped PPO loss.

    adv_estimator: "flow_grpo": (r - mean_group) / (std + std_eps), clamped to +-adv_clip_max.
    std_mode: "global" (std over the whole batch, Flow-GRPO default) or "group" (per prompt).
    zero_std_policy: a group whose reward std <= zero_std_threshold has zero advantages; "drop"
        removes its rows from the update (as Flow-GRPO does with rows whose advantage is zero),
        "keep" leaves them in, where they add nothing to the policy gradient but still count in
        its mean (shrinking it by the share of such rows) and in the KL term. Either way the
        trainer reports their share as `zero_std_ratio`.
    clip_range: PPO ratio clip epsilon. kl_beta: weight of the KL to the reference (LoRA off).
    old_log_prob: PPO denominator: the rollout's log-prob, or a recompute by the trainer before
        the update.
    train_timestep_fraction: fraction of each sample's SDE-window steps that are trained.
    shuffle_advantages: the control run of a learning comparison: the step's advantages are
        permuted over its trained rows (seeded from trainer.seed and the step), so the update
        keeps their distribution and size but loses their link to the images. A run that learns
        only when this is false learns from its reward, not from drift (docs/training.md).
    """

    adv_estimator: Literal["flow_grpo"] = "flow_grpo"
    std_mode: StdMode = "global"
    std_eps: float = 1e-4
    adv_clip_max: float = 5.0
    zero_std_policy: Literal["keep", "drop"] = "drop"
    zero_std_threshold: float = 1e-6
    clip_range: float = 1e-4
    kl_beta: float = 0.0
    old_log_prob: OldLogProbSource = "rollout"
    train_timestep_fraction: float = 1.0
    shuffle_advantages: bool = False

    def validate(self) -> "AlgorithmConfig":
        check_choices(self, "algorithm")
        for name in ("std_eps", "adv_clip_max", "clip_range"):
            _check_min(f"algorithm.{name}", getattr(self, name), 0.0, strict=True)
        _check_min("algorithm.kl_beta", self.kl_beta, 0.0)
        _check_min("algorithm.zero_std_threshold", self.zero_std_threshold, 0.0)
        if not 0.0 < self.train_timestep_fraction <= 1.0:
            _fail("algorithm.train_timestep_fraction", self.train_timestep_fraction, "must be in (0, 1]")
        return self


@dataclass
class LoraConfig:
    """LoRA adapter (peft). enabled=False means full fine-tuning of the transformer.

    init: "default" (peft's kaiming A, zero B), "gaussian", "pissa", "olora", "orthogonal".
    """

    enabled: bool = True
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init: Literal["default", "gaussian", "pissa", "olora", "orthogonal"] = "gaussian"
    dropout: float = 0.0

    def validate(self) -> "LoraConfig":
        check_choices(self, "trainer.lora")
        _check_min("trainer.lora.rank", self.rank, 1)
        _check_min("trainer.lora.alpha", self.alpha, 0.0, strict=True)
        if not 0.0 <= self.dropout < 1.0:
            _fail("trainer.lora.dropout", self.dropout, "must be in [0, 1)")
        if self.enabled and not self.target_modules:
            _fail(
                "trainer.lora.target_modules",
                self.target_modules,
                "list the module names to adapt, e.g. [to_q, to_k, to_v, to_out.0]",
            )
        return self


@dataclass
class EmaConfig:
    """An exponential moving average of the trained weights (Flow-GRPO's: decay 0.9 every 8
    optimizer steps), which validation samples with and checkpoints save beside the weights.

    After every `update_every`-th optimizer step t: ema += (1 - d) * (weights - ema), with
    d = min(decay, (1 + t) / (10 + t)) (a warm-up: early averages follow the weights faster).
    """

    enabled: bool = False
    decay: float = 0.9
    update_every: int = 8

    def validate(self) -> "EmaConfig":
        if not 0.0 <= self.decay < 1.0:
            _fail("trainer.ema.decay", self.decay, "must be in [0, 1), e.g. 0.9")
        _check_min("trainer.ema.update_every", self.update_every, 1)
        return self


@dataclass
class TrainerConfig:
    """The training loop.

    total_steps: training steps (one rollout batch + its updates each); epochs: passes over the
        prompt dataset (None: cycle until total_steps). Training stops at whichever comes first.
    prompts_per_step: prompts per step; the step holds prompts_per_step * rollout.n samples.
    update_epochs: passes of updates over one rollout batch.
    updates_per_step: optimizer steps per pass: the pass's samples (shuffled) split into this many
        mini-batches of (nearly) equal size, one optimizer step each; every step after the first
        is slightly off-policy, which is where the PPO clip acts (the references use 2).
    micro_batch_size: samples per forward/backward in the update; gradients accumulate over a
        mini-batch's micro-batches, every trained (sample, step) pair weighing the same.
    steps_per_forward: trained window steps of a micro-batch's samples scored in one forward (its
        rows: samples x steps x CFG rows); 1 runs one forward + backward per trained step. More
        rows per forward launch fewer, larger kernels, and keep that many times the activations.
    gradient_checkpointing: recompute each block's forward in the backward instead of keeping its
        activations (less memory, about half a forward more work per trained pair): true, false,
        or "auto": on only when one micro-batch's activations, measured at the first update, do
        not fit in the device's free memory (flowrl.trainer.checkpointing).
    activation_memory_budget: the share (0 < x <= 1) of the activations the compiled training
        graphs keep for their backward, against torch's default partition (1, the default): below
        1 the graphs recompute the rest in the backward, the elementwise results (norms,
        activations, casts) first and matrix products only where the budget needs more
        (flowrl.accel.set_training_activation_budget). Less memory per micro-batch, so a larger
        micro-batch, or one without gradient checkpoints (which recompute a whole forward), fits
        (docs/training.md gives measured sizes). Needs engine.compile.
    cuda_graphs: replay the compiled blocks' training forwards and backwards as CUDA graphs
        (inductor's CUDA graph trees; needs engine.compile and a GPU, not with sharded weights),
        so the host launches each block's kernels at once. The same kernels, so the same update;
        the graphs keep their activations' memory between updates, and each new micro-batch
        shape is recorded once. Off by default: on the Qwen-Image recipe it did not pay
        (docs/performance.md); `flowrl bench logprob --cuda-graphs both` measures a recipe.
    ema: an exponential moving average of the trained weights (EmaConfig).
    resume: "auto" (the newest verified checkpoint in output_dir, if any), "never", or a checkpoint
        path. A new run refuses a folder holding another run's files (flowrl.trainer.resume).
    overwrite: a new run deletes another run's files in output_dir first (and nothing else).
    save_every / val_every / log_every: in steps; 0 disables saving / validation.
    num_val_images: validation prompts (one ODE sample each, fixed seeds).
    async_rollout: one-step-ahead training (decoupled only, docs/training.md): step k+1's rollouts
        run on the rollout servers, with the weights step k started from, while step k trains.
        Every sample is then one weight update stale (from the second step on); the PPO ratio is
        taken against its own rollout log-prob (algorithm.old_log_prob=rollout).
    """

    output_dir: str = "outputs/flowrl"
    total_steps: int = 30
    epochs: int | None = None
    prompts_per_step: int = 4
    update_epochs: int = 1
    updates_per_step: int = 1
    micro_batch_size: int = 8
    steps_per_forward: int = 1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    mixed_precision: MixedPrecision = "no"
    gradient_checkpointing: GradientCheckpointing = False
    activation_memory_budget: float = 1.0
    cuda_graphs: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    save_every: int = 10
    val_every: int = 10
    resume: str = "auto"
    overwrite: bool = False
    log_every: int = 1
    seed: int = 42
    num_val_images: int = 4
    async_rollout: bool = False

    def validate(self) -> "TrainerConfig":
        check_choices(self, "trainer")
        for name in (
            "total_steps",
            "epochs",
            "prompts_per_step",
            "update_epochs",
            "updates_per_step",
            "micro_batch_size",
            "steps_per_forward",
            "log_every",
        ):
            _check_min(f"trainer.{name}", getattr(self, name), 1)
        for name in ("save_every", "val_every", "num_val_images", "weight_decay"):
            _check_min(f"trainer.{name}", getattr(self, name), 0)
        _check_min("trainer.lr", self.lr, 0.0, strict=True)
        _check_min("trainer.grad_clip", self.grad_clip, 0.0, strict=True)
        if not 0.0 < self.activation_memory_budget <= 1.0:
            _fail(
                "trainer.activation_memory_budget",
                self.activation_memory_budget,
                "it is the share of the default activations kept, in (0, 1]; use 1 for torch's default",
            )
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            _fail("trainer.betas", self.betas, "both Adam betas must be in [0, 1), e.g. [0.9, 0.999]")
        if not self.output_dir:
            _fail("trainer.output_dir", self.output_dir, "give a folder for checkpoints and metrics")
        if not self.resume:
            _fail("trainer.resume", self.resume, "use 'auto', 'never' or a checkpoint path")
        if not 0 <= self.seed <= MAX_SEED:
            _fail("trainer.seed", self.seed, f"must be in [0, {MAX_SEED}]")
        self.lora.validate()
        self.ema.validate()
        return self


@dataclass
class RewardConfig:
    """What scores the images (the rewards' slice).

    name / options: a single registered reward and its options (the reward registry,
        `flowrl.rewards.registered_rewards()`, is the one list of names; the trainer checks the
        name against it before loading the model). components: a weighted sum of
        rewards instead, each {name, weight (1.0), options ({}), optional (False: a failure
        raises; True: the row gets NaN and is excluded)}; set name=null when using components.
    route_by_data_source: data_source -> reward name, for datasets that mix tasks.
    num_workers: reward scoring threads of each rank (scoring overlaps generation); "auto": the
        cores this process may use, shared by the ranks of its host, less one
        (flowrl.rewards.async_scoring.scoring_workers).
    """

    name: str | None = "jpeg_compressibility"
    options: dict = field(default_factory=dict)
    components: list[dict] = field(default_factory=list)
    route_by_data_source: dict[str, str] = field(default_factory=dict)
    num_workers: ScoringWorkers = "auto"

    def validate(self) -> "RewardConfig":
        if self.num_workers != "auto":
            _check_min("reward.num_workers", self.num_workers, 1)
        if self.components and self.name is not None:
            _fail(
                "reward.name",
                self.name,
                "reward.components is set too; set reward.name=null to "
                "use the weighted sum of components, or remove reward.components",
            )
        if not self.components and not self.name:
            _fail("reward.name", self.name, "name a reward (e.g. jpeg_compressibility) or give reward.components")
        if self.components and self.options:
            _fail("reward.options", self.options, "with reward.components put options inside each component")
        for index, component in enumerate(self.components):
            _validate_component(f"reward.components.{index}", component)
        return self

    def resolved_components(self) -> list[dict]:
        """The reward as a list of complete component dicts (a single reward is one component)."""
        if not self.components:
            return [{"name": self.name, "weight": 1.0, "options": dict(self.options), "optional": False}]
        return [{"weight": 1.0, "options": {}, "optional": False, **c} for c in self.components]


def _validate_component(key: str, component: dict) -> None:
    for name in component:
        if name not in REWARD_COMPONENT_KEYS:
            close = difflib.get_close_matches(str(name), REWARD_COMPONENT_KEYS, n=1)
            allowed = ", ".join(REWARD_COMPONENT_KEYS)
            hint = f"did you mean {key}.{close[0]}?" if close else f"allowed: {allowed}"
            _fail(f"{key}.{name}", component[name], f"unknown key; {hint}")
    if not isinstance(component.get("name"), str) or not component["name"]:
        _fail(f"{key}.name", component.get("name"), "each component needs a reward name")
    weight = component.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        _fail(f"{key}.weight", weight, "must be a number")
    if not isinstance(component.get("options", {}), dict):
        _fail(f"{key}.options", component["options"], "must be a mapping of option -> value")
    if not isinstance(component.get("optional", False), bool):
        _fail(f"{key}.optional", component["optional"], "must be true or false")


@dataclass
class DataConfig:
    """Prompt datasets (.txt: one prompt per line; .jsonl / .parquet: one row per prompt).

    train_path / val_path: None uses the embedded tiny prompt list (train) / the train prompts (val).
    prompt_field: the column holding the prompt text in jsonl/parquet rows.
    max_prompts: keep only the first N prompts (None: all).
    """

    train_path: str | None = None
    val_path: str | None = None
    prompt_field: str = "prompt"
    shuffle: bool = True
    max_prompts: int | None = None

    def validate(self) -> "DataConfig":
        for name in ("train_path", "val_path"):
            path = getattr(self, name)
            if path is not None and not path.endswith(DATA_SUFFIXES):
                _fail(f"data.{name}", path, f"use a file ending in {', '.join(DATA_SUFFIXES)}")
        if not self.prompt_field:
            _fail("data.prompt_field", self.prompt_field, "name the column holding the prompt, e.g. prompt")
        _check_min("data.max_prompts", self.max_prompts, 1)
        return self


@dataclass
class LoggingConfig:
    """Where metrics go (metrics.jsonl under trainer.output_dir is always written)."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "flowrl"
    progress_bar: bool = True
    log_images: bool = True

    def validate(self) -> "LoggingConfig":
        if self.wandb and not self.wandb_project:
            _fail("logging.wandb_project", self.wandb_project, "name a wandb project")
        return self


# How the processes of a run are started (flowrl.distributed), and the collective backend.
Launcher = Literal["auto", "torchrun", "ray", "none"]
DistributedBackend = Literal["auto", "nccl", "gloo"]


@dataclass
class DistributedConfig:
    """Data-parallel training over several processes (docs/distributed.md).

    launcher: "auto": the ranks torchrun started when its environment (RANK, WORLD_SIZE) is set,
        else one process; "torchrun": the same, but an error when not started by torchrun;
        "ray": `num_workers` Ray Train workers started from this process; "none": one process.
    num_workers: the world size of a Ray launch (one GPU each when the cluster has GPUs);
        torchrun takes its world size from its own --nnodes / --nproc-per-node.
    address: the Ray cluster to join ("auto", "HOST:6379", "ray://HOST:10001"); None starts a
        local Ray on this machine, bound to 127.0.0.1.
    backend: the torch.distributed backend: "auto" is nccl on CUDA devices and gloo on the CPU.
    timeout_s: how long a collective waits for the other ranks before the job fails (a rank that
        died or hangs ends the run then, not never); it must cover the longest stretch between two
        collectives: a step's rollout, a validation, a checkpoint write.
    max_restarts: Ray only: how many times a failed worker group restarts, resuming from the
        latest checkpoint (torchrun takes its own --max-restarts).
    """

    launcher: Launcher = "auto"
    num_workers: int = 1
    address: str | None = None
    backend: DistributedBackend = "auto"
    timeout_s: float = 1800.0
    max_restarts: int = 0

    def validate(self) -> "DistributedConfig":
        check_choices(self, "distributed")
        _check_min("distributed.num_workers", self.num_workers, 1)
        _check_min("distributed.timeout_s", self.timeout_s, 0.0, strict=True)
        _check_min("distributed.max_restarts", self.max_restarts, 0)
        if self.launcher != "ray":
            for name, default in (("num_workers", 1), ("address", None), ("max_restarts", 0)):
                if getattr(self, name) != default:
                    _fail(
                        f"distributed.{name}",
                        getattr(self, name),
                        f"it applies to distributed.launcher=ray only (launcher is {self.launcher!r}); set "
                        "distributed.launcher=ray, or start the ranks with torchrun (docs/distributed.md)",
                    )
        return self


@dataclass
class FlowRLConfig:
    """The root: one slice per component. Build it with `load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> "FlowRLConfig":
        check_finite(self)
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        for name in ("sampling", "val_sampling"):
            params = getattr(self.rollout, name)
            # An uncond row: true CFG on any family, or guidance_scale > 1 on the classifier-free-
            # guidance families (FLUX.1 [dev] embeds its guidance_scale instead; the engine applies
            # the family's exact rule, flowrl.models.base, once the model is known).
            field_name = "true_cfg_scale" if params.true_cfg_scale > 1 else "guidance_scale"
            uncond_row = params.true_cfg_scale > 1 or (params.guidance_scale > 1 and self.model.family != "flux")
            if uncond_row and self.engine.max_batch_rows < 2:
                _fail(
                    "engine.max_batch_rows",
                    self.engine.max_batch_rows,
                    f"rollout.{name}.{field_name}={getattr(params, field_name)} runs CFG, two rows per sample; "
                    f"use engine.max_batch_rows >= 2 or rollout.{name}.{field_name} <= 1",
                )
        if self.trainer.cuda_graphs and not self.engine.compile:
            _fail(
                "trainer.cuda_graphs",
                True,
                "CUDA graphs replay the compiled blocks' training graphs; set engine.compile=true, "
                "or trainer.cuda_graphs=false",
            )
        if self.trainer.activation_memory_budget < 1.0 and not self.engine.compile:
            _fail(
                "trainer.activation_memory_budget",
                self.trainer.activation_memory_budget,
                "it sets how the compiled training graphs split their forward and backward; set "
                "engine.compile=true, or trainer.activation_memory_budget=1",
            )
        # Cross-slice rule: a group of one has reward == its group mean, so every advantage is 0.
        if self.algorithm.adv_estimator == "flow_grpo" and self.rollout.n < 2:
            _fail(
                "rollout.n",
                self.rollout.n,
                "flow_grpo compares samples within a prompt's group, so every advantage would be "
                "0; use rollout.n >= 2 (e.g. 4 on CPU, 16 on GPU)",
            )
        if self.rollout.merge_lora:
            self._check_merge_lora()
        if self.trainer.async_rollout:
            if not self.rollout.is_decoupled:
                _fail(
                    "trainer.async_rollout",
                    True,
                    "it overlaps rollouts on rollout servers with training; set rollout.servers or "
                    "rollout.num_replicas, or trainer.async_rollout=false",
                )
            if self.algorithm.old_log_prob != "rollout":
                _fail(
                    "algorithm.old_log_prob",
                    self.algorithm.old_log_prob,
                    "with trainer.async_rollout the samples come from the previous weights, and the PPO "
                    "ratio must be taken against the policy that drew them; set algorithm.old_log_prob=rollout",
                )
        return self

    def _check_merge_lora(self) -> None:
        """rollout.merge_lora's needs (RolloutConfig's docstring)."""
        if not self.trainer.lora.enabled:
            _fail(
                "rollout.merge_lora",
                True,
                "it merges the LoRA adapter into the rollout's weights, and trainer.lora.enabled=false trains "
                "no adapter; set rollout.merge_lora=false",
            )
        if self.algorithm.old_log_prob != "recompute":
            _fail(
                "algorithm.old_log_prob",
                self.algorithm.old_log_prob,
                "rollout.merge_lora samples with stochastically rounded merged weights, whose log-probs must not "
                "be the PPO ratio's denominators; set algorithm.old_log_prob=recompute or rollout.merge_lora=false",
            )
        if self.rollout.is_decoupled:
            _fail(
                "rollout.merge_lora",
                True,
                "training rollouts run on rollout servers (rollout.servers / rollout.num_replicas), which "
                "serve the adapter itself; set rollout.merge_lora=false or roll out on the trainer's engine",
            )
