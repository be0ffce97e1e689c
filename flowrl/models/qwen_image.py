"""Qwen-Image adapter over the diffusers QwenImagePipeline components.

Latent layout: packed (H/16 * W/16, 64) tokens (2x2 patches of the 16-channel VAE latent), the
transformer's input layout; noise is drawn in the unpacked (16, H/8, W/8) layout and packed, so a
seed gives the same start as the pipeline. Text: Qwen2.5-VL hidden states through the pipeline's
own chat-template encoder, variable length per prompt; batched rows are right-padded and masked.
Schedule: dynamic shift with mu from the packed image token count. Timestep scaling: sigma.
CFG is "true CFG" with the guided vector rescaled to the cond vector's norm, as the pipeline does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models import qwen_modulation
from flowrl.models.base import FlowModelAdapter, PromptEncoding, cfg_forward_inputs, combine_cfg, pad_encodings, rows_to_device, to_uint8
from flowrl.models.qwen_block import prepare_for_compile
from flowrl.models.qwen_vae import decode_single_frames_in_2d, single_frame_2d
from flowrl.models.schedule import schedule_sigmas


class QwenImageAdapter(FlowModelAdapter):
    family = "qwen_image"
    size_multiple = 16  # VAE factor 8 times the 2x2 packing
    default_lora_targets = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    )
    # Inductor stores a pointwise result in its own buffer once its expression passes
    # `realize_opcount_threshold` operations (default 30). With compile_rounding "eager", the
    # emulated bf16 casts push expressions past it: first the q/k RMSNorm + RoPE one (its rotated
    # q and k were stored in float32 and rounded by three more kernels; one B=16 block 7.285 ->
    # 7.076 ms on an H200, docs/benchmarks.md run 17). Rollout graphs now build q and k with a
    # hand-written kernel (flowrl.models.qk_norm_rope), and the threshold still keeps the first
    # LayerNorm + modulation kernel at 0.072 ms instead of 0.105 (block 7.071 vs 7.085 ms, run 22).
    # No-grad graphs only: the training graphs keep inductor's default, the configuration whose
    # rollout-vs-trainer gap runs 20-23 measured. (Run 18 timed a 544 ms training step with the
    # threshold in them too, against 256 ms without in run 14; later runs found that figure
    # varying up to 1.7x between runs of identical graphs, so that comparison is not settled.)
    no_grad_inductor_options = {"realize_opcount_threshold": 200}

    def __init__(self, pipeline, device, dtype, max_sequence_length: int = 1024, true_cfg_renorm: bool = True):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self.true_cfg_renorm = true_cfg_renorm
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.latent_channels = self.vae.config.z_dim
        self._sigma_cache: dict[tuple[int, int], torch.Tensor] = {}
        # Rollout forwards read each block's modulation from a per-timestep table
        # (flowrl/models/qwen_modulation.py); False computes it in every forward.
        self.modulation_table = True
        self._modulation: qwen_modulation.ModulationTable | None = None
        decode_single_frames_in_2d(self.vae)  # taken only inside `decode` (see flowrl/models/qwen_vae.py)

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype=torch.float32, max_sequence_length: int = 1024):
        from diffusers import QwenImagePipeline

        pipeline = QwenImagePipeline.from_pretrained(str(path), dtype=dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (pipeline.transformer, pipeline.vae, pipeline.text_encoder):
            module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length)

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        out = []
        for row, length in enumerate(lengths):
            length = int(length)
            row_mask = torch.ones(length, dtype=torch.bool, device=self.device)
            out.append(PromptEncoding(embeds[row, :length], row_mask, None))
        return out

    # --- latents and schedule ----------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        return ((h // 2) * (w // 2), self.latent_channels * 4)

    def initial_noise(self, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        noise = torch.randn((1, 1, self.latent_channels, h, w), generator=generator, dtype=torch.float32, device=generator.device)
        return self.pack(noise[:, 0], h, w)[0]

    def pack(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, C, h, w) -> (B, h/2 * w/2, 4C): each token is a 2x2 patch, channel-major."""
        b, c = latents.shape[:2]
        x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Inverse of pack: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
        b, _, d = tokens.shape
        c = d // 4
        x = tokens.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        seq_len = self.latent_shape(height, width)[0]
        key = (num_steps, seq_len)
        if key not in self._sigma_cache:
            self._sigma_cache[key] = schedule_sigmas(self.scheduler, num_steps, image_seq_len=seq_len, linear_base=True)
        return self._sigma_cache[key]

    # --- transformer ---------------------------------------------------------------------------
    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None):
        hidden, timestep, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, mask, _ = pad_encodings(encodings)
        # Lengths are known on the host, so deciding whether a mask is needed costs no sync;
        # without padding we pass no mask (the pipeline does the same, and fast kernels apply).
        lengths = {e.embeds.shape[0] for e in encodings}
        h, w = self._latent_hw(height, width)
        rows = hidden.shape[0]
        # Compiled blocks run a batch of 1 as 2 identical rows (see compile_in_place). Doing it here,
        # before the input projections lay the rows out sequence-major, lets batch 1 reuse the
        # blocks' batch >= 2 graph instead of compiling one for a batch-major layout.
        padded = rows == 1 and getattr(self.transformer, "_flowrl_compile_ready", False)
        repeat = (lambda t: torch.cat([t, t])) if padded else (lambda t: t)  # noqa: E731
        table_rows = None
        if sigma_values is not None:
            row_sigmas = list(sigma_values) + [sigma_values[i] for i in cfg_rows]
            table_rows = self._modulation_rows(row_sigmas * (1 + padded))
        out = self.transformer(
            hidden_states=repeat(hidden.to(self.dtype)),
            timestep=repeat(timestep.to(self.dtype)),
            encoder_hidden_states=repeat(embeds.to(self.dtype)),
            encoder_hidden_states_mask=repeat(mask) if len(lengths) > 1 else None,
            img_shapes=[[(1, h // 2, w // 2)]] * (rows + padded),
            attention_kwargs=None if table_rows is None else {qwen_modulation.ROWS_KEY: table_rows},
            return_dict=False,
        )[0][:rows].float()
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=self.true_cfg_renorm)

    def _modulation_rows(self, row_sigmas: list[float]) -> torch.Tensor | None:
        """Device indices of each row's timestep in the modulation table (flowrl.models.qwen_modulation),
        or None where the table does not apply: with grad (the trainer), with `modulation_table`
        off, or on blocks the table cannot serve."""
        if torch.is_grad_enabled() or not self.modulation_table:
            return None
        if self._modulation is None:
            if not qwen_modulation.applicable(self.transformer):
                return None
            self._modulation = qwen_modulation.ModulationTable(self.transformer)
        def schedule() -> list[float]:  # read only when the table is built, not at every step
            return [s for sigmas in self._sigma_cache.values() for s in sigmas.tolist()]

        rows = rows_to_device(self._modulation.rows(row_sigmas, self.device.type, schedule), self.device)
        torch._dynamo.maybe_mark_dynamic(rows, 0)  # one compiled graph for every batch size, as the activations
        return rows

    def compile_modules(self, backend: str = "inductor", rounding: str = "eager") -> list[str]:
        """Regional compile, after switching the transformer to real-arithmetic RoPE and
        sequence-major blocks (flowrl/models/qwen_block.py); the switch happens once and changes
        no parameter."""
        prepare_for_compile(self.transformer)
        return super().compile_modules(backend, rounding)

    # --- VAE -----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        x = self.unpack(latents, h, w)[:, :, None]  # (B, C, 1, h, w): one video frame
        config = self.vae.config
        mean = torch.tensor(config.latents_mean, device=x.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=x.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        x = x * std + mean
        with single_frame_2d():  # an image is one frame: 2D convolutions, a third of the FLOPs
            image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return to_uint8(image)
