"""What a training step computes, in FLOPs, and how fast its phases ran against the device's peak:
the per-phase throughput and MFU every training run logs (`perf/*`, as torchtitan logs MFU), and the
trainer's trainable setup on a bare model (while counting, and for the benchmark's peer loop).

FLOPs are counted once per configuration with torch.utils.flop_counter (flowrl.run.flops), on
one representative call of each kind, on the eager model with the trainer's LoRA in place and
before anything is compiled (a compiled model's custom ops have no FLOP formulas):
- `forward_per_row`: one transformer row at the training size (a sample has `rows_per_sample` of
  them, the adapter's guidance rule: two with an uncond row);
- `rollout_forward_per_row`: the same as a training rollout runs it: with rollout.merge_lora on the
  merged weights (flowrl.accel.lora_merge), so without the low-rank GEMMs, and
  `merge_per_rollout`, the merge's own GEMMs once per rollout; otherwise `forward_per_row` and 0;
- `decode_per_image`: one VAE decode;
- `train_per_sample_step`: forward + backward of one sample's rows at one trained step, without
  gradient checkpointing's recomputed forward;
- the forward and decode at the validation size.

A phase's FLOPs are the work the algorithm needs (each algorithm counts its own phases from these
units: `Algorithm.phase_flops`). What an implementation adds is left out (gradient checkpointing's
recomputed forward, the compiled trainer's value pass), so a phase's limit (its FLOPs at the
device's matmul peak) is the same for any implementation of the algorithm, and its MFU says how
close one comes to it. `StepPerf` turns a step's timings into `perf/<phase>_tflops` (the achieved
rate, in teraFLOPs a second), `perf/<phase>_mfu` (against the matmul peak measured when the run starts, on a GPU) and
the step's images per second and MFU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from flowrl.models.base import MIXED_PRECISION_DTYPES, mixed_precision
from flowrl.models.lora import apply_trainable, has_lora
from flowrl.run.flops import count_flops, decode_flops_per_image, transformer_flops_per_row


def window_size(params) -> int:
    """SDE window steps per sample: the explicit window, the drawn window's size, or every step
    but the last."""
    if params.sde_window is not None:
        return params.sde_window[1] - params.sde_window[0]
    return params.sde_window_size or params.num_inference_steps - 1


def trained_steps_per_sample(cfg) -> int:
    """Window steps trained per sample (as flowrl.trainer.update plans them)."""
    window = window_size(cfg.rollout.sampling)
    return min(window, max(1, int(window * float(cfg.algorithm.train_timestep_fraction) + 1e-9)))


@contextlib.contextmanager
def trainable(transformer: torch.nn.Module, trainer_cfg):
    """The trainer's trainable parameters (LoRA initialised from trainer.seed, or the whole
    transformer) on a bare transformer for the duration, as flowrl.models.lora sets them up;
    removed afterwards, so that the trainer sets itself up on the same modules as on a fresh model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(trainer_cfg.seed)
        params = apply_trainable(transformer, trainer_cfg.lora)
    try:
        yield params
    finally:
        for param in params:
            param.grad = None
        if has_lora(transformer):
            transformer.unload_lora()
        transformer.requires_grad_(False)


@dataclass
class UnitFlops:
    forward_per_row: int
    decode_per_image: int
    train_per_sample_step: int
    val_forward_per_row: int
    val_decode_per_image: int
    rows_per_sample: int  # adapter.rows_per_sample of rollout.sampling
    val_rows_per_sample: int  # and of rollout.val_sampling
    rollout_forward_per_row: int | None = None  # None: forward_per_row (no merged rollout)
    merge_per_rollout: int = 0

    def __post_init__(self) -> None:
        if self.rollout_forward_per_row is None:
            self.rollout_forward_per_row = self.forward_per_row

    def as_dict(self) -> dict:
        return asdict(self)

    def rollout(self, cfg) -> int:
        """A training step's rollout: every sample's forwards at every step and its decode (on
        merged weights with rollout.merge_lora, plus the merge)."""
        s = cfg.rollout.sampling
        samples = cfg.trainer.prompts_per_step * cfg.rollout.n
        per_sample = s.num_inference_steps * self.rows_per_sample * self.rollout_forward_per_row
        return samples * (per_sample + self.decode_per_image) + self.merge_per_rollout

    def validation(self, cfg, val_images: int) -> int:
        """A validation of `val_images` images: their forwards at every step and their decodes."""
        v = cfg.rollout.val_sampling
        return val_images * (
            v.num_inference_steps * self.val_rows_per_sample * self.val_forward_per_row + self.val_decode_per_image
        )


def _merged_rollout_flops(adapter, cfg, prompt: str) -> tuple[int, int]:
    """(a row-forward on merged weights, one merge) at the training size (module docstring)."""
    from flowrl.accel import merged_lora

    def merge() -> None:
        with merged_lora(adapter.transformer, seed=0):
            pass

    s = cfg.rollout.sampling
    with merged_lora(adapter.transformer, seed=0):
        forward = transformer_flops_per_row(
            adapter, s.height, s.width, prompt, s.num_frames, counting_sigma(adapter, s)
        )
    return forward, count_flops(merge)


def counting_sigma(adapter, sampling) -> float:
    """The noise level the counted forwards run at: 0.5, or, where another module predicts there
    (Wan2.2-A14B's other expert), the first sigma of the schedule of `sampling` the trained module
    predicts, so that they run the module with the LoRA and the gradients."""
    if bool(adapter.is_trained_sigma(torch.tensor([0.5]))):
        return 0.5
    sigmas = adapter.sigmas(sampling.num_inference_steps, sampling.height, sampling.width)[:-1].float().cpu()
    trained = sigmas[adapter.is_trained_sigma(sigmas)]
    return float(trained[0]) if len(trained) else 0.5


def count_unit_flops(adapter, cfg, prompt: str) -> UnitFlops:
    """The counts of the module docstring (call inside `trainable`, before compiling)."""
    s, v = cfg.rollout.sampling, cfg.rollout.val_sampling
    at = counting_sigma(adapter, s)
    forward = transformer_flops_per_row(adapter, s.height, s.width, prompt, s.num_frames, sigma=at)
    decode = decode_flops_per_image(adapter, s.height, s.width, s.num_frames)
    same_size = (v.height, v.width, v.num_frames) == (s.height, s.width, s.num_frames)
    val_forward = (
        forward if same_size else transformer_flops_per_row(adapter, v.height, v.width, prompt, v.num_frames, sigma=at)
    )
    val_decode = decode if same_size else decode_flops_per_image(adapter, v.height, v.width, v.num_frames)
    cond = adapter.encode_prompts([prompt])
    rows, val_rows = adapter.rows_per_sample(s), adapter.rows_per_sample(v)
    uncond = adapter.encode_prompts([s.negative_prompt or ""]) if rows == 2 else [None]
    device = adapter.device
    latents = torch.randn((1, *adapter.latent_shape(s.height, s.width, **adapter.frame_kwargs(s))), device=device)
    sigma, cfg_scale = torch.full((1,), at, device=device), torch.full((1,), adapter.cfg_scale(s), device=device)
    guidance = adapter.guidance_embedding_kwargs(torch.full((1,), s.guidance_scale, device=device))
    autocast_dtype = MIXED_PRECISION_DTYPES[cfg.trainer.mixed_precision]
    transformer = adapter.transformer
    checkpointing = transformer.is_gradient_checkpointing
    if checkpointing:
        transformer.disable_gradient_checkpointing()

    def forward_backward():
        with torch.enable_grad(), mixed_precision(device, autocast_dtype):
            velocity = adapter.velocity(latents, sigma, cond, uncond, cfg_scale, s.height, s.width, **guidance)
        velocity.float().square().mean().backward()

    try:
        train = count_flops(forward_backward)
    finally:
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        for param in transformer.parameters():
            param.grad = None
    merged = _merged_rollout_flops(adapter, cfg, prompt) if cfg.rollout.merge_lora else (forward, 0)
    return UnitFlops(forward, decode, train, val_forward, val_decode, rows, val_rows, *merged)


# The phases a step's metrics time (timing/<phase>_s) whose FLOPs an algorithm counts.
TIMED_PHASES = ("rollout", "old_log_prob", "update", "validation")


class StepPerf:
    """A run's FLOP units and the device's matmul peak (None where not measured: on a CPU), and the
    algorithm's count of a step's phase FLOPs: `phase_flops(units, rows_trained, val_images)`."""

    def __init__(self, units: UnitFlops, peak_flops: float | None, phase_flops: Callable[..., dict]):
        self.units, self.peak_flops, self.phase_flops = units, peak_flops, phase_flops

    def metrics(self, metrics: dict, samples: int) -> dict:
        """perf/* of a step from its metrics (timing/<phase>_s, adv/num_rows_trained) and its
        number of samples."""
        flops = self.phase_flops(self.units, int(metrics.get("adv/num_rows_trained", 0)), 0)
        perf = self._phases(flops, metrics)
        step_s = metrics.get("timing/step_s")
        if step_s:
            perf["perf/images_per_second"] = samples / step_s
            perf["perf/step_tflops"] = sum(flops.values()) / step_s / 1e12
            if self.peak_flops:
                perf["perf/mfu"] = sum(flops.values()) / step_s / self.peak_flops
        return perf

    def validation_metrics(self, images: int, seconds: float) -> dict:
        """perf/validation_* of a validation of `images` images that took `seconds`."""
        flops = {"validation": self.phase_flops(self.units, 0, images).get("validation", 0.0)}
        return self._phases(flops, {"timing/validation_s": seconds})

    def _phases(self, flops: dict, metrics: dict) -> dict:
        perf = {}
        for phase in TIMED_PHASES:
            seconds, count = metrics.get(f"timing/{phase}_s"), flops.get(phase, 0.0)
            if count and seconds:
                perf[f"perf/{phase}_tflops"] = count / seconds / 1e12
                if self.peak_flops:
                    perf[f"perf/{phase}_mfu"] = count / seconds / self.peak_flops
        return perf
