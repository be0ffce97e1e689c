"""CLIP-family rewards from local weights: CLIP score, PickScore-style score, aesthetic predictor.

All three load a transformers `CLIPModel` + `CLIPTokenizer` from a local folder (`model_path`,
as written by `save_pretrained`); nothing is fetched from a hub. Image preprocessing is done
here in torch (resize the short side to the model's image size with antialiased bicubic, center
crop, normalize with the mean/std of `preprocessor_config.json`, else CLIP's), so torchvision
is not needed.

- clip_score:  scale * cos(image embedding, text embedding)
- pickscore:   scale * exp(logit_scale) * cos(...)   (PickScore's formula; its checkpoint is a
               CLIP model, and `logit_scale` comes from that checkpoint)
- aesthetic:   a head of linear layers on the L2-normalized image embedding, weights from a
               safetensors file (see `load_linear_head` for the key layout); the prompt is unused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from flowrl.rewards.base import Reward

# OpenAI CLIP's normalization; used when the folder has no preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _existing_path(option: str, value, reward_name: str, want_dir: bool) -> Path:
    path = Path(str(value)).expanduser()
    ok = path.is_dir() if want_dir else path.is_file()
    if not ok:
        kind = "folder (save_pretrained output)" if want_dir else "file"
        raise ValueError(f"{reward_name} option {option}={str(value)!r} is not an existing {kind}; give a local path")
    return path


def preprocess_images(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, 3, size, size) float32: short side to `size`, center crop, normalize."""
    pixels = images.float() / 255.0
    height, width = pixels.shape[-2:]
    scale = size / min(height, width)
    new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
    if (new_h, new_w) != (height, width):
        pixels = torch.nn.functional.interpolate(
            pixels, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False
        )
        pixels = pixels.clamp(0.0, 1.0)  # bicubic overshoots; uint8 pipelines clip here too
    top, left = (new_h - size) // 2, (new_w - size) // 2
    pixels = pixels[:, :, top : top + size, left : left + size]
    mean_t = torch.tensor(mean, dtype=pixels.dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype).view(1, 3, 1, 1)
    return (pixels - mean_t) / std_t


class ClipBackbone:
    """A local CLIP model + tokenizer + preprocessing settings, producing projected embeddings.
    `model`: weights already loaded (e.g. converted from OpenCLIP), else the folder's CLIPModel."""

    def __init__(self, model_path, reward_name: str, device: str = "cpu", dtype: str = "float32", model=None):
        from transformers import CLIPModel, CLIPTokenizer

        folder = _existing_path("model_path", model_path, reward_name, want_dir=True)
        if dtype not in _DTYPES:
            raise ValueError(f"{reward_name} option dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        self.device = torch.device(device)
        if model is None:
            model = CLIPModel.from_pretrained(str(folder), dtype=_DTYPES[dtype])
        self.model = model.to(self.device, _DTYPES[dtype]).eval()
        self.model.requires_grad_(False)  # a frozen judge: no autograd state, ever
        self.tokenizer = CLIPTokenizer.from_pretrained(str(folder))
        if len(self.tokenizer) <= 2:  # transformers may return an empty tokenizer instead of raising
            raise ValueError(f"{reward_name}: no usable tokenizer in {folder} (vocab size {len(self.tokenizer)})")
        self.image_size = int(self.model.config.vision_config.image_size)
        self.mean, self.std = CLIP_MEAN, CLIP_STD
        preprocessor = folder / "preprocessor_config.json"
        if preprocessor.is_file():
            settings = json.loads(preprocessor.read_text())
            self.mean = tuple(settings.get("image_mean", self.mean))
            self.std = tuple(settings.get("image_std", self.std))
        self.max_text_length = min(
            int(self.tokenizer.model_max_length), int(self.model.config.text_config.max_position_embeddings)
        )

    @torch.inference_mode()
    def image_embeddings(self, images: np.ndarray) -> torch.Tensor:
        pixels = preprocess_images(torch.from_numpy(images), self.image_size, self.mean, self.std)
        pixels = pixels.to(self.device, self.model.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return self.model.visual_projection(pooled).float()

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_text_length, return_tensors="pt"
        ).to(self.device)
        pooled = self.model.text_model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
        ).pooler_output
        return self.model.text_projection(pooled).float()

    def cosine(self, images: np.ndarray, prompts: list[str]) -> torch.Tensor:
        image_emb = torch.nn.functional.normalize(self.image_embeddings(images), dim=-1)
        text_emb = torch.nn.functional.normalize(self.text_embeddings(prompts), dim=-1)
        return (image_emb * text_emb).sum(-1)


def _check_batch_size(reward_name: str, batch_size) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{reward_name} option batch_size={batch_size!r} must be an integer >= 1")
    return batch_size


class ClipScoreReward(Reward):
    name = "clip_score"

    def __init__(
        self,
        model_path: str,
        scale: float = 1.0,
        batch_size: int = 32,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        self.backbone = self.load_backbone(model_path, device, dtype)
        self.scale = float(scale)
        self.batch_size = _check_batch_size(self.name, batch_size)

    def load_backbone(self, model_path, device: str, dtype: str) -> ClipBackbone:
        return ClipBackbone(model_path, self.name, device, dtype)

    def _score_chunk(self, images, prompts) -> torch.Tensor:
        return self.scale * self.backbone.cosine(images, prompts)

    def score_batch(self, images, prompts, metadata):
        chunks = [
            self._score_chunk(images[i : i + self.batch_size], prompts[i : i + self.batch_size])
            for i in range(0, len(prompts), self.batch_size)
        ]
        return torch.cat(chunks).double().cpu().numpy()


class PickScoreReward(ClipScoreReward):
    name = "pickscore"

    def _score_chunk(self, images, prompts) -> torch.Tensor:
        logit_scale = self.backbone.model.logit_scale.detach().float().exp().cpu()
        return self.scale * logit_scale * self.backbone.cosine(images, prompts)


def load_linear_head(
    head_path: Path, input_dim: int, reward_name: str
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Linear layers from a safetensors file, applied in the order of the numbers in their keys.

    Keys are `<prefix><i>.weight` (out, in) with optional `<prefix><i>.bias` (out,), e.g. the
    LAION aesthetic MLP's `layers.0.weight ... layers.7.weight`; a single `weight`/`bias` pair
    is a linear head. The first layer takes `input_dim` features and the last one outputs 1.
    """
    from safetensors.torch import load_file

    tensors = load_file(str(head_path))
    weight_keys = [key for key in tensors if key.endswith("weight")]
    if not weight_keys:
        raise ValueError(f"{reward_name}: head file {head_path} has no '*weight' tensors; keys: {sorted(tensors)}")

    def natural_order(key: str):
        return tuple(int(number) for number in re.findall(r"\d+", key)), key

    layers, expected_in = [], input_dim
    for key in sorted(weight_keys, key=natural_order):
        weight = tensors[key].float()
        bias = tensors.get(key[: -len("weight")] + "bias")
        if weight.ndim != 2 or weight.shape[1] != expected_in:
            raise ValueError(
                f"{reward_name}: head layer {key!r} in {head_path} has shape {tuple(weight.shape)}, "
                f"expected (out, {expected_in}); the head must chain from the CLIP embedding size {input_dim}"
            )
        layers.append((weight, None if bias is None else bias.float()))
        expected_in = weight.shape[0]
    if expected_in != 1:
        raise ValueError(f"{reward_name}: head in {head_path} ends with {expected_in} outputs; it must end with 1")
    return layers


_ACTIVATIONS = {"none": lambda x: x, "relu": torch.relu, "gelu": torch.nn.functional.gelu}


class AestheticReward(Reward):
    name = "aesthetic"

    def __init__(
        self,
        model_path: str,
        head_path: str,
        activation: str = "none",
        normalize_embeddings: bool = True,
        batch_size: int = 32,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"aesthetic option activation={activation!r} is not one of {sorted(_ACTIVATIONS)}")
        self.backbone = ClipBackbone(model_path, self.name, device, dtype)
        head_file = _existing_path("head_path", head_path, self.name, want_dir=False)
        self.layers = load_linear_head(head_file, int(self.backbone.model.config.projection_dim), self.name)
        self.activation = _ACTIVATIONS[activation]
        self.normalize_embeddings = bool(normalize_embeddings)
        self.batch_size = _check_batch_size(self.name, batch_size)

    def head(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Apply the linear layers, with the activation between (not after) them."""
        hidden = embeddings.cpu()
        for index, (weight, bias) in enumerate(self.layers):
            hidden = torch.nn.functional.linear(hidden, weight, bias)
            if index < len(self.layers) - 1:
                hidden = self.activation(hidden)
        return hidden.squeeze(-1)

    def score_batch(self, images, prompts, metadata):
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            embeddings = self.backbone.image_embeddings(images[start : start + self.batch_size])
            if self.normalize_embeddings:
                embeddings = torch.nn.functional.normalize(embeddings, dim=-1)
            scores.append(self.head(embeddings))
        return torch.cat(scores).double().numpy()
