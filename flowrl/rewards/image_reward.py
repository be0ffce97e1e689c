"""`image_reward`: ImageReward (BLIP + an MLP head) from its released checkpoint in a local folder.

ImageReward reads the prompt with BLIP's text encoder (BERT with cross-attention to the image
tokens of a ViT), takes the first token's output and maps it through a chain of linear layers
(no activation between them) to one number, then standardises it with the training set's
statistics: score = (head(features) - 0.16717362830052426) / 1.0333394966054072 (ImageReward's
constants). The prompt is tokenized to 35 tokens (padded, truncated), as ImageReward does.

The folder holds the checkpoint as released (`ImageReward.pt`: keys `blip.visual_encoder.*`,
`blip.text_encoder.*`, `mlp.layers.*`) and a BERT tokenizer (`vocab.txt` or `tokenizer.json`,
e.g. bert-base-uncased's). The architecture comes from the tensors' shapes; the heads from
`head_width` (64 in both towers of the released model). transformers' BLIP vision and text models
hold the weights (their names match BLIP's but for the vision tower's, renamed here); images are
preprocessed as the CLIP rewards do, with CLIP's mean and std (BLIP's).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flowrl.rewards.base import Reward
from flowrl.rewards.clip_scores import (
    _DTYPES,
    CLIP_MEAN,
    CLIP_STD,
    _check_batch_size,
    _existing_path,
    preprocess_images,
)

CHECKPOINT_NAME = "ImageReward.pt"
SCORE_MEAN, SCORE_STD = 0.16717362830052426, 1.0333394966054072
MAX_TEXT_TOKENS = 35
_VISION_NAMES = [  # BLIP's ViT (timm names) -> transformers' BlipVisionModel
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def _part(state: dict, prefix: str) -> dict:
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def _depth(keys, pattern: str) -> int:
    return 1 + max(int(match.group(1)) for key in keys if (match := re.match(pattern, key)))


def _rename_vision(vision: dict) -> dict:
    renamed = {}
    for key, value in vision.items():
        for pattern, replacement in _VISION_NAMES:
            if re.search(pattern, key):
                renamed[re.sub(pattern, replacement, key)] = value
                break
    return renamed


def image_reward_parts(state: dict, head_width: int = 64):
    """(BlipVisionModel, BlipTextModel, head layers [(weight, bias)]) holding ImageReward's weights."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    state = {key.removeprefix("module."): value for key, value in state.items()}
    vision = _rename_vision(_part(state, "blip.visual_encoder."))
    text = {k: v for k, v in _part(state, "blip.text_encoder.").items() if not k.startswith("pooler.")}
    width, _, patch, _ = vision["embeddings.patch_embedding.weight"].shape
    num_patches = vision["embeddings.position_embedding"].shape[1] - 1
    vision_config = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=_depth(vision, r"encoder\.layers\.(\d+)\."),
        num_attention_heads=width // head_width,
        image_size=round(num_patches**0.5) * patch,
        patch_size=patch,
        layer_norm_eps=1e-6,  # BLIP's ViT
    )
    vocab_size, text_width = text["embeddings.word_embeddings.weight"].shape
    text_config = BlipTextConfig(
        vocab_size=vocab_size,
        hidden_size=text_width,
        encoder_hidden_size=width,
        intermediate_size=text["encoder.layer.0.intermediate.dense.weight"].shape[0],
        num_hidden_layers=_depth(text, r"encoder\.layer\.(\d+)\."),
        num_attention_heads=text_width // head_width,
        max_position_embeddings=text["embeddings.position_embeddings.weight"].shape[0],
        bos_token_id=None,
        sep_token_id=None,
        pad_token_id=0,
    )
    vision_model = BlipVisionModel(vision_config)
    vision_model.load_state_dict(vision, strict=True)
    text_model = BlipTextModel(text_config, add_pooling_layer=False)
    text.pop("embeddings.position_ids", None)
    text_model.load_state_dict(text, strict=False)
    missing = set(text_model.state_dict()) - set(text) - {"embeddings.position_ids"}
    if missing:
        raise KeyError(f"text encoder weights missing: {sorted(missing)[:5]}")
    head = _part(state, "mlp.layers.")
    indices = sorted({int(key.split(".")[0]) for key in head})
    layers = [(head[f"{i}.weight"].float(), head[f"{i}.bias"].float()) for i in indices]
    if not layers or layers[0][0].shape[1] != text_width or layers[-1][0].shape[0] != 1:
        raise KeyError(f"the mlp head must chain from {text_width} features to 1 (mlp.layers.N.weight/bias)")
    return vision_model.eval(), text_model.eval(), layers


class ImageRewardReward(Reward):
    name = "image_reward"

    def __init__(
        self, model_path: str, batch_size: int = 32, device: str = "cpu", dtype: str = "float32", head_width: int = 64
    ):
        from transformers import BertTokenizer

        folder = _existing_path("model_path", model_path, self.name, want_dir=True)
        if dtype not in _DTYPES:
            raise ValueError(f"image_reward option dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        self.batch_size = _check_batch_size(self.name, batch_size)
        missing = [] if (folder / CHECKPOINT_NAME).is_file() else [f"the checkpoint {CHECKPOINT_NAME}"]
        if not any((folder / name).is_file() for name in ("vocab.txt", "tokenizer.json")):
            missing.append("a BERT tokenizer (vocab.txt or tokenizer.json, e.g. bert-base-uncased's)")
        if missing:
            raise ValueError(
                f"image_reward option model_path={str(model_path)!r} is incomplete: it lacks {' and '.join(missing)}; "
                "put the released ImageReward checkpoint and a BERT tokenizer's files in it"
            )
        state = torch.load(Path(folder) / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
        try:
            vision, text, self.head = image_reward_parts(state.get("state_dict", state), head_width)
        except (KeyError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"image_reward: {folder / CHECKPOINT_NAME} is not an ImageReward state dict ({type(error).__name__}: "
                f"{error}); use the released ImageReward.pt"
            ) from None
        self.device = torch.device(device)
        self.vision = vision.to(self.device, _DTYPES[dtype]).requires_grad_(False)
        self.text = text.to(self.device, _DTYPES[dtype]).requires_grad_(False)
        self.tokenizer = BertTokenizer.from_pretrained(str(folder))
        if len(self.tokenizer) <= 5:  # transformers may return an empty tokenizer instead of raising
            raise ValueError(f"image_reward: no usable tokenizer in {folder} (vocab size {len(self.tokenizer)})")
        self.image_size = int(vision.config.image_size)

    @torch.inference_mode()
    def _score_chunk(self, images, prompts) -> torch.Tensor:
        pixels = preprocess_images(torch.from_numpy(images), self.image_size, CLIP_MEAN, CLIP_STD)
        image_tokens = self.vision(pixel_values=pixels.to(self.device, self.vision.dtype)).last_hidden_state
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt"
        ).to(self.device)
        features = (
            self.text(
                input_ids=tokens["input_ids"],
                attention_mask=tokens["attention_mask"],
                encoder_hidden_states=image_tokens,
                encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long, device=self.device),
            )
            .last_hidden_state[:, 0]
            .float()
            .cpu()
        )
        for weight, bias in self.head:
            features = torch.nn.functional.linear(features, weight, bias)
        return (features.squeeze(-1) - SCORE_MEAN) / SCORE_STD

    def score_batch(self, images, prompts, metadata):
        chunks = [
            self._score_chunk(images[i : i + self.batch_size], prompts[i : i + self.batch_size])
            for i in range(0, len(prompts), self.batch_size)
        ]
        return torch.cat(chunks).double().numpy()
