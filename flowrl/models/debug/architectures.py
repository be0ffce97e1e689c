"""The published architectures that `model.path=random:NAME` (and `flowrl bench --model NAME`)
builds with random weights: each model's transformer, VAE and scheduler config as its diffusers
checkpoint states them, and the text geometry of its prompts (tokens, width, pooled width).
Plain data; flowrl.models.debug.random_weights builds from it. The `tiny-*` names are the tiny
pipelines of flowrl.models.debug.tiny (their family is the tiny kind)."""

from __future__ import annotations

SD3_MEDIUM_TRANSFORMER = dict(  # stabilityai/stable-diffusion-3-medium's (no dual attention, no QK norm)
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
)
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
SD35_LARGE_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)
SD35_MEDIUM_VAE = dict(  # SD3-medium's and SD3.5-large's VAE too
    in_channels=3,
    out_channels=3,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5305,
)
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE = dict(  # AutoencoderKLQwenImage's defaults are the published config; stated here
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
)
QWEN_IMAGE_SCHEDULER = dict(
    base_shift=0.5,
    max_shift=0.9,
    use_dynamic_shifting=True,
    shift_terminal=0.02,
    time_shift_type="exponential",
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift=1.0,
)
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_DEV_VAE = dict(SD35_MEDIUM_VAE, shift_factor=0.1159, scaling_factor=0.3611)  # the same AutoencoderKL
FLUX_DEV_SCHEDULER = dict(  # FLUX.1 [dev]'s scheduler_config.json (the tiny FLUX pipeline's too)
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)

Z_IMAGE_TRANSFORMER = dict(  # Tongyi-MAI/Z-Image-Turbo's (the undistilled Z-Image's is the same)
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)
Z_IMAGE_VAE = FLUX_DEV_VAE  # Z-Image uses FLUX.1's VAE
# Z-Image's scheduler_config.json (fixed shift 6, no dynamic shifting; the tiny Z-Image pipeline's too)
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)

# Wan (flowrl.models.wan): the transformers of Wan2.1-T2V-1.3B, Wan2.1-T2V-14B and Wan2.2-TI2V-5B
# (dims, heads, FFN widths and depths of the Wan configs: 1536/12/8960/30, 5120/40/13824/40,
# 3072/24/14336/30; head width 128, patches (1, 2, 2), UMT5-XXL text width 4096). Each of
# Wan2.2-T2V-A14B's two experts has Wan2.1-14B's architecture.
WAN21_1_3B_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN21_14B_TRANSFORMER = dict(WAN21_1_3B_TRANSFORMER, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN22_5B_TRANSFORMER = dict(
    WAN21_1_3B_TRANSFORMER, num_attention_heads=24, ffn_dim=14336, in_channels=48, out_channels=48
)
WAN21_VAE = dict(  # AutoencoderKLWan's defaults are Wan2.1's VAE (also the A14B experts'); stated here
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
# Wan2.2's VAE: 48 latent channels, 16x spatial compression through a 2x2 patch around residual
# 3D blocks. Its per-channel latent statistics are not reproduced (random weights: mean 0, std 1).
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    in_channels=12,
    out_channels=12,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    is_residual=True,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)
# The Wan checkpoints' scheduler: UniPC over flow sigmas with a fixed shift (3.0 for Wan2.1-T2V at
# 480p, 5.0 for Wan2.2-TI2V-5B); flowrl steps its sigmas with its own SDE/ODE steps.
WAN_SCHEDULER = dict(
    _class_name="UniPCMultistepScheduler",
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    num_train_timesteps=1000,
    flow_shift=3.0,
)
WAN22_SCHEDULER = dict(WAN_SCHEDULER, flow_shift=5.0)
# Wan2.2-T2V-A14B: the high-noise expert (`transformer`) predicts at sigma >= its boundary_ratio,
# the low-noise one (`transformer_2`) below; over the Wan2.1 VAE, flow shift 12.
WAN22_A14B_BOUNDARY = 0.875
WAN22_A14B_SCHEDULER = dict(WAN_SCHEDULER, flow_shift=12.0)

# name -> (family, text tokens, text width, pooled width or None)
ARCHITECTURES: dict[str, tuple[str, int, int, int | None]] = {
    "sd3-medium": ("sd3", 77 + 256, 4096, 2048),
    "sd35-medium": ("sd3", 77 + 256, 4096, 2048),
    "sd35-large": ("sd3", 77 + 256, 4096, 2048),
    "qwen-image": ("qwen_image", 64, 3584, None),
    "flux-dev": ("flux", 512, 4096, 768),
    "z-image": ("z_image", 64, 2560, None),
    "tiny-sd3": ("sd3", 77 + 32, 64, 64),
    "tiny-qwen": ("qwen_image", 16, 32, None),
    "tiny-flux": ("flux", 512, 64, 32),
    "tiny-z-image": ("z_image", 16, 32, None),
    "wan2.1-1.3b": ("wan2.1", 512, 4096, None),
    "wan2.1-14b": ("wan2.1", 512, 4096, None),
    "wan2.2-5b": ("wan2.2", 512, 4096, None),
    "wan2.2-a14b": ("wan2.2", 512, 4096, None),
    "tiny-wan": ("wan2.1", 32, 32, None),
    "tiny-wan2.2": ("wan2.2", 32, 32, None),
}


SD3_SCHEDULER = dict(shift=3.0)  # SD3-medium's, SD3.5-medium's and -large's scheduler_config.json

# name -> (transformer class, config, VAE class, config, scheduler config) of the random-weight models
RANDOM_WEIGHT_MODULES: dict[str, tuple[str, dict, str, dict, dict]] = {
    "sd3-medium": ("SD3Transformer2DModel", SD3_MEDIUM_TRANSFORMER, "AutoencoderKL", SD35_MEDIUM_VAE, SD3_SCHEDULER),
    "sd35-medium": ("SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER, "AutoencoderKL", SD35_MEDIUM_VAE, SD3_SCHEDULER),
    "sd35-large": ("SD3Transformer2DModel", SD35_LARGE_TRANSFORMER, "AutoencoderKL", SD35_MEDIUM_VAE, SD3_SCHEDULER),
    "qwen-image": (
        "QwenImageTransformer2DModel",
        QWEN_IMAGE_TRANSFORMER,
        "AutoencoderKLQwenImage",
        QWEN_IMAGE_VAE,
        QWEN_IMAGE_SCHEDULER,
    ),
    "flux-dev": ("FluxTransformer2DModel", FLUX_DEV_TRANSFORMER, "AutoencoderKL", FLUX_DEV_VAE, FLUX_DEV_SCHEDULER),
    "z-image": ("ZImageTransformer2DModel", Z_IMAGE_TRANSFORMER, "AutoencoderKL", Z_IMAGE_VAE, Z_IMAGE_SCHEDULER),
    "wan2.1-1.3b": ("WanTransformer3DModel", WAN21_1_3B_TRANSFORMER, "AutoencoderKLWan", WAN21_VAE, WAN_SCHEDULER),
    "wan2.1-14b": ("WanTransformer3DModel", WAN21_14B_TRANSFORMER, "AutoencoderKLWan", WAN21_VAE, WAN_SCHEDULER),
    "wan2.2-5b": ("WanTransformer3DModel", WAN22_5B_TRANSFORMER, "AutoencoderKLWan", WAN22_VAE, WAN22_SCHEDULER),
    "wan2.2-a14b": (
        "WanTransformer3DModel",
        WAN21_14B_TRANSFORMER,
        "AutoencoderKLWan",
        WAN21_VAE,
        WAN22_A14B_SCHEDULER,
    ),
}
# name -> the pipeline settings of the checkpoint's model_index.json beyond its modules:
# Wan2.2-TI2V-5B's per-token timesteps, Wan2.2-T2V-A14B's boundary between its experts (with one,
# a second transformer of the same architecture, `transformer_2`, is built beside the first).
PIPELINE_SETTINGS: dict[str, dict] = {
    "wan2.2-5b": {"expand_timesteps": True},
    "wan2.2-a14b": {"boundary_ratio": WAN22_A14B_BOUNDARY},
}

# family -> text tokens before the max_sequence_length part of its fixed-length prompt encoding
# (SD3: CLIP's 77, then T5's max_sequence_length; FLUX: T5's alone, CLIP-L giving only the pooled
# vector): a random-weight model of such a family given model.max_sequence_length has prompts of
# this prefix + that length (Wan pads every prompt to max_sequence_length with zeros). Other families (Qwen-Image, Z-Image) encode a prompt as long as it is:
# the table's tokens, capped at max_sequence_length.
FIXED_LENGTH_TEXT: dict[str, int] = {"sd3": 77, "flux": 0, "wan2.1": 0, "wan2.2": 0}
