"""CLIP-family rewards on a tiny random CLIP built in code (hand-built tokenizer, no hub)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowrl.rewards import build_reward
from flowrl.rewards.clip_scores import CLIP_MEAN, CLIP_STD, preprocess_images

WORDS = sorted({"a", "photo", "of", "cat", "dog", "red", "blue", "car", "tree", "sign", "the", "on", "sunny", "street"})
PROMPTS = ["a photo of a cat", "a red car on the street", "blue sign", "a tree"]


def _tiny_clip_tokenizer():
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(symbol, len(vocab))
        vocab.setdefault(symbol + "</w>", len(vocab))
    merges = []
    for word in WORDS:  # one merge chain per word: (w0, w1), (w0w1, w2), ... with </w> on the last symbol
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        merged = symbols[0]
        for symbol in symbols[1:]:
            if (merged, symbol) not in merges:
                merges.append((merged, symbol))
            merged += symbol
            vocab.setdefault(merged, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


@pytest.fixture(scope="module")
def tiny_clip_path(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel

    tokenizer = _tiny_clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    folder = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _images(num_rows: int, height: int = 40, width: int = 56) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (num_rows, 3, height, width), dtype=np.uint8)


def test_tokenizer_is_real():
    tokenizer = _tiny_clip_tokenizer()
    assert len(tokenizer) > 500
    assert len(tokenizer("a photo of a cat")["input_ids"]) == 2 + 5  # bos, one token per word, eos


def test_clip_score_is_the_cosine_of_the_models_own_forward(tiny_clip_path):
    reward = build_reward({"name": "clip_score", "options": {"model_path": str(tiny_clip_path)}})
    images = _images(4)
    scores = reward(images, PROMPTS, [{}] * 4)
    backbone = reward.backbone
    pixels = preprocess_images(torch.from_numpy(images), backbone.image_size, backbone.mean, backbone.std)
    tokens = backbone.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = backbone.model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels
        )
        expected = output.logits_per_image.diagonal() / backbone.model.logit_scale.exp()
    np.testing.assert_allclose(scores, expected.double().numpy(), atol=1e-5)
    assert scores.dtype == np.float64 and (np.abs(scores) <= 1 + 1e-6).all()
    assert np.ptp(scores) > 0  # different rows really differ


def test_batch_invariance_scale_and_pickscore(tiny_clip_path):
    path = str(tiny_clip_path)
    images = _images(4)
    clip = build_reward({"name": "clip_score", "options": {"model_path": path}})(images, PROMPTS, [{}] * 4)
    chunked = build_reward({"name": "clip_score", "options": {"model_path": path, "batch_size": 1, "scale": 2.5}})
    np.testing.assert_allclose(chunked(images, PROMPTS, [{}] * 4), 2.5 * clip, atol=1e-5)
    pick = build_reward({"name": "pickscore", "options": {"model_path": path}})
    logit_scale = float(pick.backbone.model.logit_scale.exp())
    assert logit_scale > 1.5  # a non-trivial scale, so the check below could fail
    np.testing.assert_allclose(pick(images, PROMPTS, [{}] * 4), logit_scale * clip, atol=1e-4)


def test_preprocessing_crops_and_normalizes_with_folder_statistics(tiny_clip_path):
    flat = np.full((1, 3, 40, 90), 200, np.uint8)
    pixels = preprocess_images(torch.from_numpy(flat), 32, CLIP_MEAN, CLIP_STD)
    assert pixels.shape == (1, 3, 32, 32)
    expected = (200 / 255 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(pixels[0, :, 5, 7], expected, atol=1e-5, rtol=0)
    (tiny_clip_path / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    )
    try:
        reward = build_reward({"name": "clip_score", "options": {"model_path": str(tiny_clip_path)}})
        assert reward.backbone.mean == (0.5, 0.5, 0.5)
    finally:
        (tiny_clip_path / "preprocessor_config.json").unlink()


def test_aesthetic_head_on_normalized_embeddings(tiny_clip_path, tmp_path):
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    linear = {"weight": torch.randn(1, 16, generator=generator), "bias": torch.randn(1, generator=generator)}
    save_file(linear, tmp_path / "linear.safetensors")
    reward = build_reward(
        {
            "name": "aesthetic",
            "options": {"model_path": str(tiny_clip_path), "head_path": str(tmp_path / "linear.safetensors")},
        }
    )
    images = _images(3)
    embeddings = torch.nn.functional.normalize(reward.backbone.image_embeddings(images), dim=-1)
    expected = embeddings @ linear["weight"][0] + linear["bias"][0]
    np.testing.assert_allclose(reward(images, [""] * 3, [{}] * 3), expected.double().numpy(), atol=1e-5)

    # A LAION-style MLP: layers.{i} in numeric order (layers.10 after layers.2), relu between.
    mlp = {
        "layers.0.weight": torch.randn(8, 16, generator=generator),
        "layers.0.bias": torch.randn(8, generator=generator),
        "layers.2.weight": torch.randn(4, 8, generator=generator),
        "layers.10.weight": torch.randn(1, 4, generator=generator),
    }
    save_file(mlp, tmp_path / "mlp.safetensors")
    reward = build_reward(
        {
            "name": "aesthetic",
            "options": {
                "model_path": str(tiny_clip_path),
                "activation": "relu",
                "head_path": str(tmp_path / "mlp.safetensors"),
            },
        }
    )
    hidden = torch.relu(embeddings @ mlp["layers.0.weight"].T + mlp["layers.0.bias"])
    expected = torch.relu(hidden @ mlp["layers.2.weight"].T) @ mlp["layers.10.weight"][0]
    np.testing.assert_allclose(reward(images, [""] * 3, [{}] * 3), expected.double().numpy(), atol=1e-5)


def test_bad_paths_and_heads_are_named(tiny_clip_path, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="model_path='/no/such/dir'"):
        build_reward({"name": "clip_score", "options": {"model_path": "/no/such/dir"}})
    save_file({"weight": torch.zeros(1, 7)}, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"wrong.safetensors.*\(1, 7\).*16"):
        build_reward(
            {
                "name": "aesthetic",
                "options": {
                    "model_path": str(tiny_clip_path),
                    "head_path": str(tmp_path / "wrong.safetensors"),
                },
            }
        )
    with pytest.raises(ValueError, match="head_path"):
        build_reward(
            {
                "name": "aesthetic",
                "options": {"model_path": str(tiny_clip_path), "head_path": str(tmp_path / "x")},
            }
        )
