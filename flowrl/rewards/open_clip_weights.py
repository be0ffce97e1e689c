"""OpenCLIP checkpoints (as HPS v2 ships its weights) as a transformers `CLIPModel`.

`clip_from_open_clip(state_dict, ...)` reads the architecture from the tensors' shapes (widths,
depths, patch size, image size, context length), renames OpenCLIP's keys to transformers' and
splits each fused attention input projection into q, k and v. The head counts are not in the
shapes: OpenCLIP states them as head widths (ViT-H/14: 80 for the image tower, 64 for the text).
Both towers use exact GELU (OpenCLIP's default for models trained without QuickGELU, ViT-H/14
among them). The text embedding is read at the end-of-text token (`eos_token_id`), as OpenCLIP
reads it at the highest token id, which that token is in CLIP's vocabulary.
"""

from __future__ import annotations

import torch

_BLOCK_NAMES = {  # OpenCLIP residual block -> transformers encoder layer
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def _blocks(state: dict, prefix: str, target: str, out: dict) -> int:
    """Convert the residual blocks under `prefix` into `out` under `target`; return their count."""
    depth = 1 + max(int(key[len(prefix) :].split(".")[0]) for key in state if key.startswith(prefix))
    for index in range(depth):
        source, dest = f"{prefix}{index}.", f"{target}{index}."
        for part in ("weight", "bias"):
            for q_k_v, name in zip(state[f"{source}attn.in_proj_{part}"].chunk(3), ("q", "k", "v")):
                out[f"{dest}self_attn.{name}_proj.{part}"] = q_k_v
            for old, new in _BLOCK_NAMES.items():
                out[f"{dest}{new}.{part}"] = state[f"{source}{old}.{part}"]
    return depth


def clip_from_open_clip(
    state_dict: dict, eos_token_id: int, vision_head_width: int = 80, text_head_width: int = 64
) -> torch.nn.Module:
    """A transformers CLIPModel holding an OpenCLIP CLIP's weights (module docstring)."""
    from transformers import CLIPConfig, CLIPModel

    state = {key.removeprefix("module."): value for key, value in state_dict.items()}
    out = {
        "logit_scale": state["logit_scale"],
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].t(),
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].t(),
    }
    text_depth = _blocks(state, "transformer.resblocks.", "text_model.encoder.layers.", out)
    vision_depth = _blocks(state, "visual.transformer.resblocks.", "vision_model.encoder.layers.", out)
    vocab_size, text_width = state["token_embedding.weight"].shape
    vision_width, _, patch_size, _ = state["visual.conv1.weight"].shape
    num_patches = state["visual.positional_embedding"].shape[0] - 1
    config = CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=text_width,
            intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=text_depth,
            num_attention_heads=text_width // text_head_width,
            max_position_embeddings=state["positional_embedding"].shape[0],
            hidden_act="gelu",
            eos_token_id=eos_token_id,
        ),
        vision_config=dict(
            hidden_size=vision_width,
            intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=vision_depth,
            num_attention_heads=vision_width // vision_head_width,
            patch_size=patch_size,
            image_size=round(num_patches**0.5) * patch_size,
            hidden_act="gelu",
        ),
        projection_dim=state["text_projection"].shape[1],
    )
    model = CLIPModel(config)
    model.load_state_dict(out, strict=True)
    return model.eval()
