"""flowrl configuration sections: one dataclass per component, each with `validate()`.

Every field is documented by the docstring under it (an attribute docstring, as cleanrl and
torchtitan write them); `flowrl.config.reference` reads them back, and docs/config.md's tables are
generated from them (a test holds the two equal). A key that no longer exists is listed in
`REMOVED_KEYS` with why, and a config that still sets it fails naming it.

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

from flowrl.config.algorithm_rules import check_algorithm
from flowrl.sampling_params import MAX_SEED, SamplingParams

# Choice lists that code outside this module needs too.
AlgorithmName = Literal[
    "flow_grpo", "diffusion_nft", "awm", "online_dpo"
]  # the algorithms registered in flowrl.trainer (ALGORITHMS)
StdMode = Literal["global", "group"]
OldLogProbSource = Literal["rollout", "recompute"]
MixedPrecision = Literal["no", "bf16", "fp16"]
GradientCheckpointing = bool | Literal["auto"]
ScoringWorkers = int | Literal["auto"]

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")

# Keys that existed once, and why they went: a config that sets one fails naming it. The fast
# paths behind the first four did not save 2% of a recipe's step or rollout on a GPU
# (benchmarks/results/2026-12-05_fast_paths_h200.md).
REMOVED_KEYS = {
    "trainer.cuda_graphs": "replaying the training graphs as CUDA graphs did not shorten a recipe's step",
    "trainer.activation_memory_budget": "a smaller activation budget with a larger micro-batch did not pay",
    "trainer.steps_per_forward": "several trained steps per forward saved 1% of a step for 2.6x the memory",
    "engine.compile_rounding": "compiled kernels always round where eager PyTorch does",
    "engine.prompt_cache_device": "prompt encodings are always cached in host memory",
    "algorithm.adv_estimator": "the algorithm is chosen by algorithm.name (its advantages with it)",
}
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


def is_device_name(device: str) -> bool:
    """Whether `device` is one flowrl takes: auto, cpu, cuda or cuda:N (model.device, --device)."""
    return re.fullmatch(r"auto|cpu|cuda(:\d+)?", device) is not None


def resolve_device(device: str) -> str:
    """The concrete device: "auto" becomes "cuda" when a GPU is visible, else "cpu"."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ModelConfig:
    """Which checkpoint to load and how."""

    path: str | None = None
    """Local diffusers folder (`save_pretrained`, `flowrl make-tiny`, `flowrl make-toy`), or
    `random:NAME`: random weights at a published architecture (flowrl/models/debug/architectures.py,
    with random prompt embeddings in place of the text encoders; speed and memory runs only). null:
    the embedded tiny SD3 model, built offline on first use."""
    family: Literal["auto", "sd3", "qwen_image", "flux", "z_image", "wan2.1", "wan2.2"] = "auto"
    """`auto` reads `model_index.json`; or force one family."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model weights (`float32` on CPU; `bfloat16` is usual on GPU)."""
    device: str = "auto"
    """`auto` (cuda when a GPU is visible, else cpu), `cpu`, `cuda` or `cuda:N`."""
    max_sequence_length: int | None = None
    """The prompt's text length in tokens (SD3: T5's, after CLIP's 77; FLUX: T5's; Qwen-Image and
    Z-Image: the longest prompt, shorter ones stay unpadded; Wan: every prompt padded to it). null:
    the family's default (SD3 256, FLUX 512, Qwen-Image 1024, Z-Image 512, Wan 512); the pipelines
    allow up to 512 (SD3, FLUX, Z-Image, Wan) and 1024 (Qwen-Image)."""
    trained_expert: Literal[None, "high", "low"] = None
    """For a two-expert Wan2.2 model (Wan2.2-T2V-A14B), which expert the trainer trains: `high`
    (the checkpoint's `transformer`, which predicts at sigma >= its boundary_ratio) or `low`
    (`transformer_2`, below it); the other stays frozen at the checkpoint's weights, and only the
    steps the trained expert predicts are trained (docs/video.md). Training a two-expert model
    needs it; any other model refuses it (leave it null). flowrl eval, generate and serve read it
    from a run's saved config, so a run's weights go into the expert it trained."""

    offload_text_encoders: bool = False
    """Keep the text encoders' weights on the CPU and stream them to the GPU, layer by layer, only
    while prompts are encoded (accelerate's CPU offload): frees their GPU memory (Qwen-Image: about
    17 GB, Wan's UMT5: 11 GB) for training, at the cost of copying their weights once per batch of
    new prompts. GPU only; a `random:` model has no text encoder (docs/training.md)."""

    def validate(self) -> "ModelConfig":
        check_choices(self, "model")
        if not is_device_name(self.device):
            _fail("model.device", self.device, "use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_min("model.max_sequence_length", self.max_sequence_length, 1)
        return self

    def adapter_options(self) -> dict:
        """Keyword options of the family's adapter (`flowrl.models.registry.load_adapter`): the
        settings given here, the family's defaults for those left at None."""
        options = {"max_sequence_length": self.max_sequence_length, "trained_expert": self.trained_expert}
        options["offload_text_encoders"] = self.offload_text_encoders or None
        return {name: value for name, value in options.items() if value is not None}

    def resolve_device(self) -> str:
        """The concrete device string ("auto" becomes "cuda" when a GPU is visible, else "cpu")."""
        return resolve_device(self.device)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


# torch.compile backends of `flowrl.accel.compile_adapter` (the engine's `compile`): the one list,
# which flowrl.accel reads.
CompileBackend = Literal["inductor", "aot_eager", "eager"]


@dataclass
class EngineConfig:
    """Rollout engine limits."""

    max_batch_rows: int = 32
    """Most transformer rows per forward (a CFG sample counts two)."""
    decode_chunk_size: int = 16
    """Most samples VAE-decoded at once (bounds decode memory)."""
    compile: bool = False
    """Regional torch.compile of the transformer blocks (and SD3's VAE decoder) with the fast paths
    of flowrl.accel: faster rollouts and training steps on a GPU after a one-time compilation in
    the first steps. Rollout and trainer then run different compiled graphs (no-grad, grad); where
    each log-prob's value comes from is chosen once (docs/training.md). The GPU recipes turn it on;
    on a tiny CPU model compiling costs more than it saves."""
    prompt_cache_mb: int = 1024
    """MiB of prompt encodings kept for reuse, in host memory (least recently used evicted first;
    0 disables the cache)."""

    def validate(self) -> "EngineConfig":
        for name in ("max_batch_rows", "decode_chunk_size"):
            _check_min(f"engine.{name}", getattr(self, name), 1)
        _check_min("engine.prompt_cache_mb", self.prompt_cache_mb, 0)
        check_choices(self, "engine")
        return self


def _default_sampling() -> SamplingParams:
    return SamplingParams(height=64, width=64, num_inference_steps=6, guidance_scale=1.0, noise_level=0.7)


def _default_val_sampling() -> SamplingParams:
    return _default_sampling().replace(noise_level=0.0, logprobs=False)


@dataclass
class RolloutConfig:
    """How dataset rows become rollouts (the agent loop's slice), and where they run.

    Decoupled training (docs/serving.md): with `servers` or `num_replicas`, training rollouts run
    on rollout servers instead of the trainer's own engine (validation stays in the trainer's
    process, with its weights)."""

    n: int = 4
    """Samples per prompt (the group size of group-relative advantages). Rows are repeated
    interleaved: p0 x n, then p1 x n, ..."""
    enable_batched_diffusion: bool = True
    """Send each group of n consecutive rows as ONE `engine.generate_batched(prompt, n, sampling)`
    call (one prompt encoding, samples admitted together) when that is provably safe: the engine
    supports it, n > 1, len(batch) % n == 0, and within every group agent_name, raw_prompt,
    negative_prompt and sampling settings are identical. Otherwise (or with the flag off) every
    row is its own `generate` request, all in flight at once (the engine still batches them into
    shared forwards), with identical results and row layout; the agent loop logs why it fell
    back."""
    seed: int | None = 42
    """Base seed: row i of a rollout batch gets a seed derived from it and the global row index,
    so reruns are identical. null: fresh randomness per row (`sampling.seed` must stay null)."""
    val_seed: int = 0
    """Base seed of validation rollouts, fixed so validation images compare across steps."""
    sampling: SamplingParams = field(default_factory=_default_sampling)
    """SamplingParams of training rollouts (SDE, log-probs on); its fields are listed below."""
    val_sampling: SamplingParams = field(default_factory=_default_val_sampling)
    """SamplingParams of validation rollouts (ODE: noise_level 0, no log-probs)."""
    sde_window_draw: Literal["step", "row", "progressive"] = "step"
    """How a drawn SDE window (sampling.sde_window_size) falls on a training step's rows: `step`, one
    window per training step, drawn from (trainer.seed, step) and shared by every row (flow_grpo
    draws one per process and step; MixGRPO's `random`); `row`, each row its own, drawn from the
    row's seed (verl-omni); `progressive`, MixGRPO's schedule, shared by every row: the window starts
    at the low end of sampling.sde_window_range (default 0), moves by sde_window_shift steps every
    sde_window_shift_every training steps, and starts over at the low end once it would no longer
    fit in the range."""
    sde_window_shift_every: int = 25
    """`progressive` windows only: training steps between two moves of the window (MixGRPO's
    iters_per_group: 25, 20 for MixGRPO-Flash)."""
    sde_window_shift: int = 1
    """`progressive` windows only: denoising steps the window moves by (MixGRPO's
    prog_overlap_step)."""
    merge_lora: bool = False
    """Training rollouts compute each adapted projection with the merged weight W + s B A,
    stochastically rounded to the model's dtype and made once per rollout (with engine.compile, in
    one compiled kernel per layer), instead of the base weight plus the low-rank term: faster, at
    one more copy of the adapted weights in device memory while the rollout runs. Needs a LoRA
    adapter, the trainer's own engine and, with flow_grpo, algorithm.old_log_prob=recompute. Validation and
    `flowrl eval` sample the adapter itself."""
    servers: list[str] = field(default_factory=list)
    """URLs of `flowrl serve` replicas started by the user (e.g. http://10.0.0.2:8000), all serving
    the trainer's model; training rollouts go there, balanced per group."""
    num_replicas: int = 0
    """`flowrl serve` processes the trainer starts itself (on 127.0.0.1, model.path) and stops on
    exit; 0: none. Give either servers or num_replicas, not both."""
    replica_devices: list[str] = field(default_factory=list)
    """The device of each started replica (one per replica, e.g. [cuda:1, cuda:2]); empty: every
    replica on model.device."""
    request_timeout_s: float = 600.0
    """How long a rollout request may take on a server or engine actor (queueing included) before
    the replica counts as down."""
    max_replica_failures: int = 2
    """A replica down this many times in a row is dropped for the rest of the run (its requests go
    to the others; with none left the step fails)."""
    # --- rollouts on Ray engine actors (docs/ray.md) ---
    num_ray_actors: int = 0
    """flowrl engine actors the trainer starts on a Ray cluster (model.path, one GPU each when
    model.device is a GPU) and kills on exit, instead of `flowrl serve` replicas; 0: none. The
    cluster: the Ray this process joined, else the one at RAY_ADDRESS, else a local Ray on
    127.0.0.1."""
    ray_actors: list[str] = field(default_factory=list)
    """Names of flowrl EngineActors already running on the Ray cluster (`NAME`, or
    `NAMESPACE/NAME` for an actor of another namespace), all serving the trainer's model."""

    @property
    def is_decoupled(self) -> bool:
        """Whether training rollouts run on replicas (rollout.servers, rollout.num_replicas or Ray's)."""
        return bool(self.servers) or self.num_replicas > 0 or self.is_on_ray

    @property
    def is_on_ray(self) -> bool:
        """Whether the replicas are engine actors (rollout.num_ray_actors or rollout.ray_actors)."""
        return self.num_ray_actors > 0 or bool(self.ray_actors)

    def validate(self) -> "RolloutConfig":
        _check_min("rollout.n", self.n, 1)
        check_choices(self, "rollout")
        for name in ("seed", "val_seed"):  # never mapped onto some other seed
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_SEED:
                _fail(f"rollout.{name}", value, f"must be in [0, {MAX_SEED}]")
        self._validate_replicas()
        self._validate_window_schedule()
        for name in ("sampling", "val_sampling"):
            params = getattr(self, name)
            try:
                # Every supported family (SD3, Qwen-Image, FLUX, Z-Image) needs sides that are multiples of 16;
                # checking here fails before any model is loaded.
                params.validate(size_multiple=16)
            except ValueError as error:
                raise ValueError(str(error).replace("SamplingParams.", f"rollout.{name}.")) from None
            if name == "sampling" and params.shared_initial_noise and not self.enable_batched_diffusion:
                _fail(
                    "rollout.sampling.shared_initial_noise",
                    True,
                    "a group shares its starting noise through one batched call per group; set "
                    "rollout.enable_batched_diffusion=true",
                )
            if name == "val_sampling" and params.shared_initial_noise:
                _fail(
                    "rollout.val_sampling.shared_initial_noise",
                    True,
                    "validation draws one sample per prompt, which has no group to share with; leave it false",
                )
            if params.seed is not None:
                _fail(
                    f"rollout.{name}.seed",
                    params.seed,
                    "per-row seeds derive from rollout.seed / rollout.val_seed; set those instead "
                    f"and leave rollout.{name}.seed=null",
                )
        return self

    def _validate_window_schedule(self) -> None:
        """sde_window_draw=progressive's needs; its two settings only with it."""
        _check_min("rollout.sde_window_shift_every", self.sde_window_shift_every, 1)
        _check_min("rollout.sde_window_shift", self.sde_window_shift, 1)
        if self.sde_window_draw != "progressive":
            for name, default in (("sde_window_shift_every", 25), ("sde_window_shift", 1)):
                if getattr(self, name) != default:
                    _fail(
                        f"rollout.{name}",
                        getattr(self, name),
                        f"it moves progressive windows only (rollout.sde_window_draw is {self.sde_window_draw!r}); "
                        f"set rollout.sde_window_draw=progressive or leave rollout.{name} at {default}",
                    )
        elif self.sampling.sde_window is not None or self.sampling.sde_window_size is None:
            _fail(
                "rollout.sde_window_draw",
                "progressive",
                "a progressive window needs its length and no fixed window: set rollout.sampling.sde_window_size "
                "(e.g. 4, MixGRPO's) and rollout.sampling.sde_window=null",
            )

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
        self._validate_ray()

    def _validate_ray(self) -> None:
        _check_min("rollout.num_ray_actors", self.num_ray_actors, 0)
        for index, name in enumerate(self.ray_actors):
            if not isinstance(name, str) or not name.strip("/") or name.count("/") > 1:
                _fail(f"rollout.ray_actors.{index}", name, "give an actor's name, or NAMESPACE/NAME")
        given = [key for key in ("servers", "num_replicas", "num_ray_actors", "ray_actors") if getattr(self, key)]
        if self.is_on_ray and len(given) > 1:
            _fail(
                f"rollout.{given[-1]}",
                getattr(self, given[-1]),
                f"rollout.{given[0]} is set too; give one of rollout.servers, rollout.num_replicas "
                "(`flowrl serve` replicas), rollout.num_ray_actors or rollout.ray_actors (engine actors)",
            )


@dataclass
class NftConfig:
    """DiffusionNFT's own settings (algorithm.name=diffusion_nft; arXiv 2509.16117, NVlabs'
    scripts/train_nft_sd3.py)."""

    beta: float = 1.0
    """beta of the implicit policies, v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old -
    beta v; the loss is divided by it. The reference: 1 (GenEval, PickScore), 0.1 (OCR, several rewards)."""
    old_decay_flat: int = 0
    """The old policy (the rollouts' weights) follows the trained ones with decay d = 0 for the
    first old_decay_flat optimizer steps, then min(old_decay_max, old_decay_rate * (t - flat))."""
    old_decay_rate: float = 0.001
    """The decay's growth per optimizer step (the reference's default preset; its OCR preset: flat
    75, rate 0.0075, max 0.999)."""
    old_decay_max: float = 0.5
    """The decay's ceiling, in [0, 1): 0 rolls out with the trained weights themselves."""

    def validate(self) -> "NftConfig":
        _check_min("algorithm.nft.beta", self.beta, 0.0, strict=True)
        _check_min("algorithm.nft.old_decay_flat", self.old_decay_flat, 0)
        _check_min("algorithm.nft.old_decay_rate", self.old_decay_rate, 0.0)
        if not 0.0 <= self.old_decay_max < 1.0:
            _fail("algorithm.nft.old_decay_max", self.old_decay_max, "must be in [0, 1), e.g. 0.5")
        return self


@dataclass
class AwmConfig:
    """AWM's own settings (algorithm.name=awm; arXiv 2509.25050, scxue/advantage_weighted_matching
    config/dgx_awm.py, its GenEval setting's values by default)."""

    weighting: Literal["ghuber", "uniform", "t", "t2", "huber"] = "ghuber"
    """How the flow-matching error l at noise level t becomes the surrogate log-prob -w(l, t):
    `ghuber` t ((l + 1e-10)^p - 1e-10^p) / p, `uniform` l, `t` t l, `t2` t^2 l, `huber`
    t (sqrt(l + 1e-10) - 1e-5) (flowrl/trainer/awm_loss.py)."""
    ghuber_power: float = 0.25
    """p of the `ghuber` weighting."""
    advantage_max: float = 1.0
    """Advantages clamped to +-algorithm.adv_clip_max are rescaled to +-advantage_max."""
    ema_kl_beta: float = 1.0
    """Weight of the KL on the velocity to the EMA policy, mean((v - v_ema)^2) ("mimic TRPO")."""
    ema_decay_rate: float = 0.001
    """The EMA policy follows the trained weights with decay min(ema_decay_max, ema_decay_rate * t)
    after optimizer step t (the reference's `linear` kl_ema_decay)."""
    ema_decay_max: float = 0.3
    """The EMA policy's decay ceiling, in [0, 1)."""

    def validate(self) -> "AwmConfig":
        check_choices(self, "algorithm.awm")
        _check_min("algorithm.awm.ghuber_power", self.ghuber_power, 0.0, strict=True)
        _check_min("algorithm.awm.advantage_max", self.advantage_max, 0.0, strict=True)
        _check_min("algorithm.awm.ema_kl_beta", self.ema_kl_beta, 0.0)
        _check_min("algorithm.awm.ema_decay_rate", self.ema_decay_rate, 0.0)
        if not 0.0 <= self.ema_decay_max < 1.0:
            _fail("algorithm.awm.ema_decay_max", self.ema_decay_max, "must be in [0, 1), e.g. 0.3")
        return self


@dataclass
class DpoConfig:
    """online_dpo's own settings (arXiv 2311.12908; flow_grpo config/dpo.py, verl-omni's online
    Qwen-Image recipe)."""

    beta: float = 100.0
    """beta of the DPO loss -log sigmoid(-(beta / 2) (diff_chosen - diff_rejected)) (flow_grpo and
    verl-omni's online recipe: 100; their offline defaults: 2000)."""
    ref_update_every: int = 0
    """0: the reference is the LoRA-disabled model (needs LoRA) and rollouts use the trained
    weights (verl-omni); K > 0: the reference is a snapshot of the trained weights taken every K
    training steps, which the rollouts use too (flow_grpo's ref_update_step, e.g. 40)."""

    def validate(self) -> "DpoConfig":
        _check_min("algorithm.dpo.beta", self.beta, 0.0, strict=True)
        _check_min("algorithm.dpo.ref_update_every", self.ref_update_every, 0)
        return self


@dataclass
class AlgorithmConfig:
    """The RL algorithm (flowrl.trainer's registry) and its objective's settings. The settings
    shared by every algorithm come first; those of one algorithm say so, and another algorithm
    refuses them (flowrl.config.algorithm_rules)."""

    name: AlgorithmName = "flow_grpo"
    """The algorithm: `flow_grpo` (SDE rollouts with per-step log-probs, group-relative
    advantages, the clipped PPO loss; flowrl/trainer/flow_grpo.py), `diffusion_nft` (deterministic
    rollouts from an older copy of the weights, trained on the final images through the forward
    process; flowrl/trainer/diffusion_nft.py), `awm` (deterministic rollouts from the trained
    weights, the flow-matching loss on their final images weighted by the advantage;
    flowrl/trainer/awm.py), `online_dpo` (deterministic rollouts, each group's best and worst
    sample a preference pair for Diffusion-DPO's loss; flowrl/trainer/online_dpo.py)."""
    std_mode: StdMode = "global"
    """Advantage = (r - group mean) / (std + std_eps): `global` takes the std over the whole batch
    (the Flow-GRPO default), `group` the std of the row's own group."""
    std_eps: float = 1e-4
    """Added to the std."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max."""
    zero_std_policy: Literal["keep", "drop"] = "drop"
    """A group whose reward std <= zero_std_threshold has zero advantages: `drop` removes its rows
    from the update (as Flow-GRPO drops rows whose advantage is zero), `keep` leaves them in, where
    they add nothing to the policy gradient but still count in its mean and in the KL term. Their
    share is logged as `adv/zero_std_ratio` either way."""
    zero_std_threshold: float = 1e-6
    """The reward std at or below which a group counts as having no spread."""
    kl_beta: float = 0.0
    """Weight of the KL to the reference (the same model with the LoRA disabled; needs LoRA).
    flow_grpo: Flow-GRPO's, mean((mu - mu_ref)^2) / (2 std_t^2) with the diffusion coefficient
    std_t, so the published betas apply as they are; diffusion_nft: the reference's, on the
    velocity, mean((v - v_ref)^2) (it uses 1e-4); awm: the same (it uses 0.001 for GenEval, 0.003
    for OCR)."""
    train_timestep_fraction: float = 1.0
    """Fraction of each sample's steps that are trained (a random subset per sample): of its
    SDE-window steps (flow_grpo), of its rollout's timesteps (diffusion_nft: the reference trains
    int(0.99 T) of T; awm: 6 of the first int(0.9 T))."""
    clip_range: float = 1e-4
    """flow_grpo, awm: the PPO ratio clip epsilon (AWM's reference uses 1)."""
    old_log_prob: OldLogProbSource = "rollout"
    """flow_grpo: the PPO denominator: the rollout's log-probs (`rollout`), or a recompute by the
    trainer before the update (`recompute`: the first optimizer step's samples take theirs from its
    own forwards; the rest are re-scored)."""
    policy_loss: Literal["ppo_clip", "grpo_guard", "dppo"] = "ppo_clip"
    """flow_grpo: the per-step objective (flowrl/trainer/objectives.py): `ppo_clip` (Flow-GRPO's clipped
    ratio), `grpo_guard` (GRPO-Guard: the ratio normalised per step by RatioNorm, PPO-clipped,
    each step's loss divided by its -dt; sde_type sde or dance) or `dppo` (Flow-DPPO: no clip, a step
    dropped when the old-to-new KL of its Gaussian means reaches dppo_tau and its ratio moves with
    the advantage). Both compare the step's mean with the old policy's, which the trainer
    recomputes: they need old_log_prob=recompute, and act from the second optimizer step of a
    rollout batch on (trainer.updates_per_step or update_epochs > 1)."""
    dppo_tau: float = 1e-5
    """flow_grpo, `dppo` only: the divergence at which a step that moves with its advantage is dropped
    (Flow-DPPO's tau)."""
    kl_type: Literal["mean", "velocity"] = "mean"
    """flow_grpo: the form of the KL to the reference (kl_beta > 0): `mean`, Flow-GRPO's on the step's mean
    (kl_beta's docstring); `velocity`, mean((v - v_ref)^2) on the guided velocity, as Flow-Factory's
    v-based KL, DiffusionNFT and AWM have it (flow_grpo's maintainer's advice without CFG)."""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """flow_grpo, diffusion_nft, awm: with several reward components: `sum`, advantages of the weighted sum of the rewards;
    `gdpo`, each component normalised in its group first (std per std_mode), the normalised
    components summed with their weights, the sum normalised over the batch (GDPO; Flow-Factory's
    advantage_aggregation, MixGRPO's advantage_aggr). Needs reward.components with two or more."""
    behaviour_weight_cap: float = 5.0
    """flow_grpo: decoupled PPO (AReaL, arXiv 2505.24298; verl's rollout correction) for samples drawn by older
    weights than the update starts from (trainer.async_rollout): their clipped objective, centred on
    the update's starting weights, is weighted by min(pi_start / pi_behaviour, this cap), the
    behaviour policy's log-prob being the rollout's. Samples of the current weights weigh 1."""
    shuffle_advantages: bool = False
    """The control run of a learning comparison: the step's advantages are permuted over its
    trained rows (seeded from trainer.seed and the step), so the update keeps their distribution
    and size but loses their link to the images. A run that learns only when this is false learns
    from its reward, not from drift (docs/training.md)."""
    nft: NftConfig = field(default_factory=NftConfig)
    """diffusion_nft's settings."""
    awm: AwmConfig = field(default_factory=AwmConfig)
    """awm's settings."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """online_dpo's settings."""

    def validate(self) -> "AlgorithmConfig":
        check_choices(self, "algorithm")
        self._validate_variants()
        for name in ("std_eps", "adv_clip_max", "clip_range"):
            _check_min(f"algorithm.{name}", getattr(self, name), 0.0, strict=True)
        _check_min("algorithm.kl_beta", self.kl_beta, 0.0)
        _check_min("algorithm.zero_std_threshold", self.zero_std_threshold, 0.0)
        if not 0.0 < self.train_timestep_fraction <= 1.0:
            _fail("algorithm.train_timestep_fraction", self.train_timestep_fraction, "must be in (0, 1]")
        _check_min("algorithm.behaviour_weight_cap", self.behaviour_weight_cap, 1.0)
        self.nft.validate()
        self.awm.validate()
        self.dpo.validate()
        return self

    def _validate_variants(self) -> None:
        """The FlowGRPO variants' settings (policy_loss, dppo_tau, kl_type): each only where it acts."""
        _check_min("algorithm.dppo_tau", self.dppo_tau, 0.0, strict=True)
        if self.policy_loss != "dppo" and self.dppo_tau != 1e-5:
            _fail("algorithm.dppo_tau", self.dppo_tau, "it is Flow-DPPO's threshold; set algorithm.policy_loss=dppo")
        if self.policy_loss == "dppo" and self.clip_range != 1e-4:
            _fail(
                "algorithm.clip_range",
                self.clip_range,
                "algorithm.policy_loss=dppo clips no ratio (it drops steps past algorithm.dppo_tau); "
                "leave algorithm.clip_range at 1e-4",
            )
        if self.policy_loss != "ppo_clip" and self.old_log_prob != "recompute":
            _fail(
                "algorithm.old_log_prob",
                self.old_log_prob,
                f"algorithm.policy_loss={self.policy_loss} compares each step's mean with the old policy's, which "
                "the trainer recomputes (rollouts return no means); set algorithm.old_log_prob=recompute",
            )
        if self.kl_type == "velocity" and self.kl_beta == 0:
            _fail(
                "algorithm.kl_type",
                self.kl_type,
                "there is no KL term with algorithm.kl_beta=0; set algorithm.kl_beta > 0 (e.g. 1e-4) or kl_type=mean",
            )


@dataclass
class LoraConfig:
    """The LoRA adapter (peft)."""

    enabled: bool = True
    """false: full fine-tuning of the transformer."""
    rank: int = 8
    """The adapter's rank."""
    alpha: float = 16.0
    """Its scale numerator (the low-rank term is scaled by alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names to adapt."""
    init: Literal["default", "gaussian", "pissa", "olora", "orthogonal"] = "gaussian"
    """peft's initialisation: `default` (kaiming A, zero B), `gaussian`, `pissa`, `olora`,
    `orthogonal`."""
    dropout: float = 0.0
    """LoRA dropout; above 0, compiled rollouts keep each adapted projection as two GEMMs and an add
    instead of one op (flowrl/accel/lora_fold.py)."""

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
    """An exponential moving average of the trained weights (Flow-GRPO keeps one), which validation
    samples with and checkpoints save beside the weights."""

    enabled: bool = False
    """Keep the average: validation samples with it, checkpoints save it (`ema.safetensors`), resume
    restores it, and the end of the run also writes `final/ema/`."""
    decay: float = 0.9
    """After optimizer step t, when (t + 1) is a multiple of `update_every`: ema += (1 - d)
    (weights - ema), `moves_per_update` times, with d = min(decay, (1 + t) / (10 + t)) (a warm-up:
    early averages follow the weights faster); Flow-GRPO's EMA and loop (flowrl.trainer.ema)."""
    update_every: int = 8
    """Optimizer steps between two moves of the average."""
    moves_per_update: int = 1
    """How many times the average moves at each moving optimizer step. Flow-GRPO's loop moves it
    once per training micro-batch of that optimizer step on each process, so its horizon depends on
    how its run was cut: set this to the reference run's micro-batches per optimizer step per
    process to keep its horizon (2 in its SD3.5-M OCR config, 6 in its FLUX PickScore config). With
    decay 0.9 every 8 steps, the average lags a steadily moving weight by about 75 optimizer steps
    with 1, 38 with 2 and 13 with 6."""

    def validate(self) -> "EmaConfig":
        if not 0.0 <= self.decay < 1.0:
            _fail("trainer.ema.decay", self.decay, "must be in [0, 1), e.g. 0.9")
        _check_min("trainer.ema.update_every", self.update_every, 1)
        _check_min("trainer.ema.moves_per_update", self.moves_per_update, 1)
        return self


@dataclass
class TrainerConfig:
    """The training loop."""

    output_dir: str = "outputs/flowrl"
    """Checkpoints, metrics.jsonl, tensorboard logs and images."""
    total_steps: int = 30
    """Training steps (one rollout batch and its updates each)."""
    epochs: int | None = None
    """Passes over the prompt dataset (null: cycle until total_steps); training stops at whichever
    limit comes first."""
    prompts_per_step: int = 4
    """Prompts per step; the step holds prompts_per_step * rollout.n samples. More than the dataset
    holds is allowed (a step then takes some prompts twice) and the run says so when it starts."""
    update_epochs: int = 1
    """Passes of updates over one rollout batch."""
    updates_per_step: int = 1
    """Optimizer steps per pass: the pass's samples (shuffled) split into this many mini-batches of
    (nearly) equal size, one optimizer step each; every step after the first is slightly
    off-policy, which is where the PPO clip acts (the references, and the GPU recipes, use 2)."""
    micro_batch_size: int = 8
    """Samples per forward/backward in the update; gradients accumulate over a mini-batch's
    micro-batches, every trained (sample, step) pair weighing the same whatever the cut."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Largest gradient norm (clipped above it)."""
    mixed_precision: MixedPrecision = "no"
    """`no`, `bf16` or `fp16` (GPU): torch.autocast of the trainer's forward and of the rollout
    engine's transformer (the same arithmetic on both sides)."""
    gradient_checkpointing: GradientCheckpointing = False
    """Recompute each block's forward in the backward instead of keeping its activations (less
    memory, about half a forward more work per trained pair): true, false, or `auto`: on only when
    one micro-batch's activations, measured at the first update, do not fit in the device's free
    memory (the recipes use auto)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The LoRA adapter (its keys below)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """The moving average of the weights (its keys below)."""
    save_every: int = 10
    """Steps between checkpoints; 0: none."""
    val_every: int = 10
    """Steps between validations; 0: none."""
    resume: str = "auto"
    """`auto` (the newest checkpoint in output_dir that verifies, if any), `never`, or a checkpoint
    path. A new run refuses a folder holding another run's files (docs/training.md)."""
    overwrite: bool = False
    """A new run in a folder holding another run's files deletes those files first (and nothing
    else: `metrics.jsonl`, `checkpoints/`, `final/`, `tensorboard/`, `val/`, `reward_curve.png`,
    `run_config.json`) instead of refusing to start. A folder with no checkpoint, written by an
    earlier start of the same config (a crash before the first checkpoint), restarts without it
    (docs/training.md)."""
    log_every: int = 1
    """Steps between metrics lines."""
    max_steps_without_trained_rows: int = 5
    """A run stops (exit 2, saying why) after this many steps in a row that trained no row: every
    reward NaN (a reward that returned null, an optional component failing everywhere) or every
    prompt group without reward spread (with `algorithm.zero_std_policy: drop`); the first such step
    warns; 0: warn, never stop (flowrl.run.health.NoTrainingWatch)."""
    seed: int = 42
    """The trainer's seed: LoRA initialisation, data order, trained steps, control permutations."""
    num_val_images: int = 4
    """Validation prompts (one ODE sample each, fixed seeds)."""
    async_rollout: bool = False
    """One-step-ahead training (decoupled only, docs/training.md): step k+1's rollouts run on the
    rollout servers, with the weights step k started from, while step k trains. Every sample is
    then one update stale (from the second step on: its optimizer steps, rollout/staleness_*), and
    the update is decoupled PPO: the clip centred on the weights the update starts from
    (algorithm.old_log_prob=recompute), each stale sample weighted by its truncated importance
    weight against the rollout's log-prob (algorithm.behaviour_weight_cap)."""

    def validate(self) -> "TrainerConfig":
        check_choices(self, "trainer")
        for name in (
            "total_steps",
            "epochs",
            "prompts_per_step",
            "update_epochs",
            "updates_per_step",
            "micro_batch_size",
            "log_every",
        ):
            _check_min(f"trainer.{name}", getattr(self, name), 1)
        for name in ("save_every", "val_every", "num_val_images", "weight_decay", "max_steps_without_trained_rows"):
            _check_min(f"trainer.{name}", getattr(self, name), 0)
        _check_min("trainer.lr", self.lr, 0.0, strict=True)
        _check_min("trainer.grad_clip", self.grad_clip, 0.0, strict=True)
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
    """What scores the images (the rewards' slice)."""

    name: str | None = "jpeg_compressibility"
    """A single registered reward (the registry, `flowrl.rewards.registered_rewards()`, is the one
    list of names; the trainer checks it before loading the model); null with `components`."""
    options: dict = field(default_factory=dict)
    """The reward's options."""
    components: list[dict] = field(default_factory=list)
    """A weighted sum of rewards instead: each {name, weight (1.0), options ({}), optional (false:
    a failure raises; true: the row gets NaN and is excluded)}; set name=null with it."""
    route_by_data_source: dict[str, str] = field(default_factory=dict)
    """data_source -> reward name, for datasets that mix tasks."""
    num_workers: ScoringWorkers = "auto"
    """Reward scoring threads of each rank (scoring overlaps generation); `auto`: the cores this
    process may use, shared by the ranks of its host, less one."""

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
    """Prompt datasets (.txt: one prompt per line; .jsonl / .parquet: one row per prompt, with an
    optional `ground_truth`, `negative_prompt` and `data_source`)."""

    train_path: str | None = None
    """The training prompts; null: the embedded tiny prompt list."""
    val_path: str | None = None
    """The validation prompts (same formats); null: the training prompts."""
    prompt_field: str = "prompt"
    """The column holding the prompt text in jsonl / parquet rows."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded from trainer.seed and the epoch)."""
    max_prompts: int | None = None
    """Keep only the first N prompts (null: all)."""

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
    """Tensorboard event files under trainer.output_dir/tensorboard."""
    wandb: bool = False
    """Mirror metrics and images to Weights & Biases (`pip install flowrl[wandb]`)."""
    wandb_project: str = "flowrl"
    """The wandb project."""
    progress_bar: bool = True
    """The training progress bar."""
    log_images: bool = True
    """Validation grids in tensorboard / wandb (the PNGs under val/ are always written)."""

    def validate(self) -> "LoggingConfig":
        if self.wandb and not self.wandb_project:
            _fail("logging.wandb_project", self.wandb_project, "name a wandb project")
        return self


# How the processes of a run are started (flowrl.distributed), and the collective backend.
Launcher = Literal["auto", "torchrun", "ray", "none"]
DistributedBackend = Literal["auto", "nccl", "gloo"]


@dataclass
class DistributedConfig:
    """Data-parallel training over several processes (docs/distributed.md)."""

    launcher: Launcher = "auto"
    """`auto`: the ranks torchrun started when its environment (RANK, WORLD_SIZE) is set, else one
    process; `torchrun`: the same, but an error when not started by torchrun; `ray`: num_workers
    Ray Train workers started from this process; `none`: one process."""
    num_workers: int = 1
    """Ray only: the world size (one GPU each when the cluster has GPUs); torchrun takes its own
    --nnodes / --nproc-per-node."""
    address: str | None = None
    """Ray only: the cluster to join (`auto`, `HOST:6379`, `ray://HOST:10001`); null starts a local
    Ray on this machine, bound to 127.0.0.1."""
    backend: DistributedBackend = "auto"
    """The torch.distributed backend: `auto` is nccl on CUDA devices and gloo on the CPU."""
    timeout_s: float = 1800.0
    """How long a collective waits for the other ranks before the job fails; it must cover the
    longest stretch between two collectives (a step's rollout, a validation, a checkpoint)."""
    max_restarts: int = 0
    """Ray only: how many times a failed worker group restarts, resuming from the latest checkpoint
    (torchrun takes its own --max-restarts)."""

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
        # Cross-slice rule: a group of one has reward == its group mean, so every advantage is 0.
        if self.rollout.n < 2:
            _fail(
                "rollout.n",
                self.rollout.n,
                f"{self.algorithm.name} compares samples within a prompt's group, so every advantage would be "
                "0; use rollout.n >= 2 (e.g. 4 on CPU, 16 on GPU)",
            )
        check_algorithm(self)
        self._check_flow_grpo_variants()
        flow_grpo = self.algorithm.name == "flow_grpo"
        if self.rollout.merge_lora:
            self._check_merge_lora()
        if self.trainer.async_rollout:
            self._check_async_rollout()
        if flow_grpo and self.rollout.is_decoupled and self.engine.compile and self.algorithm.old_log_prob == "rollout":
            _fail(
                "algorithm.old_log_prob",
                "rollout",
                "rollout servers sample with their own graph and engine.compile=true trains with another, so the "
                "PPO ratio would compare two graphs (whose rounding alone moves it past the clip range); set "
                "algorithm.old_log_prob=recompute (the trainer scores both sides) or engine.compile=false",
            )
        return self

    def _check_flow_grpo_variants(self) -> None:
        """What the FlowGRPO variants of algorithm need of the other slices (their docstrings)."""
        algo, sde_type = self.algorithm, self.rollout.sampling.sde_type
        if algo.policy_loss == "grpo_guard" and sde_type == "cps":
            _fail(
                "rollout.sampling.sde_type",
                sde_type,
                "algorithm.policy_loss=grpo_guard normalises Gaussian log-probs, and the cps step's drops its "
                "constants; use sde_type=sde or dance",
            )
        if algo.advantage_aggregation == "gdpo" and len(self.reward.components) < 2:
            _fail(
                "algorithm.advantage_aggregation",
                "gdpo",
                "it normalises each reward component on its own and needs reward.components with two or more "
                "rewards; give them, or set algorithm.advantage_aggregation=sum",
            )

    def _check_async_rollout(self) -> None:
        """trainer.async_rollout's needs (TrainerConfig's docstring)."""
        if not self.rollout.is_decoupled:
            _fail(
                "trainer.async_rollout",
                True,
                "it overlaps rollouts on rollout servers with training; set rollout.servers or "
                "rollout.num_replicas, or trainer.async_rollout=false",
            )
        if self.algorithm.name != "flow_grpo":  # decoupled PPO's needs below
            return
        if self.algorithm.old_log_prob != "recompute":
            _fail(
                "algorithm.old_log_prob",
                self.algorithm.old_log_prob,
                "with trainer.async_rollout the samples come from older weights: the clip is centred on the "
                "weights the update starts from (decoupled PPO), whose log-probs the trainer recomputes; set "
                "algorithm.old_log_prob=recompute",
            )
        if not self.rollout.sampling.logprobs:
            _fail(
                "rollout.sampling.logprobs",
                False,
                "with trainer.async_rollout the rollout's own log-probs weigh each stale sample (decoupled PPO's "
                "behaviour weight); set rollout.sampling.logprobs=true",
            )

    def _check_merge_lora(self) -> None:
        """rollout.merge_lora's needs (RolloutConfig's docstring)."""
        if not self.trainer.lora.enabled:
            _fail(
                "rollout.merge_lora",
                True,
                "it merges the LoRA adapter into the rollout's weights, and trainer.lora.enabled=false trains "
                "no adapter; set rollout.merge_lora=false",
            )
        if self.algorithm.name == "flow_grpo" and self.algorithm.old_log_prob != "recompute":
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
