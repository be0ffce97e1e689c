"""`image_reward` on a tiny random checkpoint in ImageReward's key layout built in the test: its
score equals an independent forward of BLIP's ViT, BLIP's cross-attending BERT and the linear head
(written here from the papers' architectures) standardised with ImageReward's constants, in any
batch size; an incomplete folder is named with the files it lacks.

The image-reward package needs torchvision (and its own BLIP code), which does not install beside
this CPU torch, so the reference is this file's forward, not the package's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.rewards import build_reward
from flowrl.rewards.clip_scores import CLIP_MEAN, CLIP_STD, preprocess_images

V_WIDTH, T_WIDTH, HEAD, PATCH, GRID, DEPTH = 32, 24, 8, 8, 4, 2
WORDS = ["a", "red", "car", "photo", "of", "dog", "blue", "sign", "on", "the", "street"]
PROMPTS = ["a red car", "a photo of a dog", "a blue sign on the street"]


def _rand(g, *shape, scale=0.1):
    return torch.randn(*shape, generator=g) * scale


def _norm(g, name, width):
    return {f"{name}.weight": 1 + _rand(g, width), f"{name}.bias": _rand(g, width)}


def _linear(g, name, n_out, n_in):
    return {f"{name}.weight": _rand(g, n_out, n_in, scale=n_in**-0.5), f"{name}.bias": _rand(g, n_out)}


def tiny_image_reward_state(vocab_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    state = {
        v + "cls_token": _rand(g, 1, 1, V_WIDTH),
        v + "pos_embed": _rand(g, 1, GRID * GRID + 1, V_WIDTH),
        v + "patch_embed.proj.weight": _rand(g, V_WIDTH, 3, PATCH, PATCH, scale=0.05),
        v + "patch_embed.proj.bias": _rand(g, V_WIDTH),
        **_norm(g, v + "norm", V_WIDTH),
        t + "embeddings.word_embeddings.weight": _rand(g, vocab_size, T_WIDTH),
        t + "embeddings.position_embeddings.weight": _rand(g, 40, T_WIDTH),
        t + "embeddings.position_ids": torch.arange(40)[None],
        **_norm(g, t + "embeddings.LayerNorm", T_WIDTH),
    }
    for i in range(DEPTH):
        b = f"{v}blocks.{i}."
        state |= _norm(g, b + "norm1", V_WIDTH) | _norm(g, b + "norm2", V_WIDTH)
        state |= _linear(g, b + "attn.qkv", 3 * V_WIDTH, V_WIDTH) | _linear(g, b + "attn.proj", V_WIDTH, V_WIDTH)
        state |= _linear(g, b + "mlp.fc1", 4 * V_WIDTH, V_WIDTH) | _linear(g, b + "mlp.fc2", V_WIDTH, 4 * V_WIDTH)
        b = f"{t}encoder.layer.{i}."
        for part, key_width in (("attention", T_WIDTH), ("crossattention", V_WIDTH)):
            state |= _linear(g, f"{b}{part}.self.query", T_WIDTH, T_WIDTH)
            state |= _linear(g, f"{b}{part}.self.key", T_WIDTH, key_width)
            state |= _linear(g, f"{b}{part}.self.value", T_WIDTH, key_width)
            state |= _linear(g, f"{b}{part}.output.dense", T_WIDTH, T_WIDTH) | _norm(
                g, f"{b}{part}.output.LayerNorm", T_WIDTH
            )
        state |= _linear(g, b + "intermediate.dense", 4 * T_WIDTH, T_WIDTH) | _linear(
            g, b + "output.dense", T_WIDTH, 4 * T_WIDTH
        )
        state |= _norm(g, b + "output.LayerNorm", T_WIDTH)
    for index, (n_out, n_in) in zip((0, 2, 4, 6, 7), ((20, T_WIDTH), (12, 20), (8, 12), (4, 8), (1, 4))):
        state |= _linear(g, f"mlp.layers.{index}", n_out, n_in)
    return state


# --- the reference: BLIP's ViT, BLIP's BERT with cross-attention, ImageReward's head ---------------
def _ln(x, s, name, eps):
    return F.layer_norm(x, x.shape[-1:], s[name + ".weight"], s[name + ".bias"], eps=eps)


def _lin(x, s, name):
    return x @ s[name + ".weight"].t() + s[name + ".bias"]


def _attend(q, k, v, mask):
    split = lambda x: x.view(*x.shape[:2], -1, HEAD).transpose(1, 2)
    weights = split(q) @ split(k).transpose(-1, -2) / math.sqrt(HEAD) + mask
    return (weights.softmax(-1) @ split(v)).transpose(1, 2).flatten(2)


def reference_scores(s, pixels, ids, mask):
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    x = F.conv2d(pixels, s[v + "patch_embed.proj.weight"], s[v + "patch_embed.proj.bias"], stride=PATCH)
    x = torch.cat([s[v + "cls_token"].expand(len(x), -1, -1), x.flatten(2).transpose(1, 2)], 1) + s[v + "pos_embed"]
    for i in range(DEPTH):  # pre-norm ViT blocks, eps 1e-6
        b = f"{v}blocks.{i}."
        q, k, val = _lin(_ln(x, s, b + "norm1", 1e-6), s, b + "attn.qkv").chunk(3, -1)
        x = x + _lin(_attend(q, k, val, 0.0), s, b + "attn.proj")
        x = x + _lin(F.gelu(_lin(_ln(x, s, b + "norm2", 1e-6), s, b + "mlp.fc1")), s, b + "mlp.fc2")
    image = _ln(x, s, v + "norm", 1e-6)
    h = s[t + "embeddings.word_embeddings.weight"][ids] + s[t + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = _ln(h, s, t + "embeddings.LayerNorm", 1e-12)
    padding = ((1 - mask[:, None, None, :].float()) * -1e9).float()
    for i in range(DEPTH):  # post-norm BERT layers: self-attention, cross-attention, feed-forward
        b = f"{t}encoder.layer.{i}."
        for part, keys, key_mask in (("attention", h, padding), ("crossattention", image, 0.0)):
            a = _attend(
                _lin(h, s, f"{b}{part}.self.query"),
                _lin(keys, s, f"{b}{part}.self.key"),
                _lin(keys, s, f"{b}{part}.self.value"),
                key_mask,
            )
            h = _ln(h + _lin(a, s, f"{b}{part}.output.dense"), s, f"{b}{part}.output.LayerNorm", 1e-12)
        ff = _lin(F.gelu(_lin(h, s, b + "intermediate.dense")), s, b + "output.dense")
        h = _ln(h + ff, s, b + "output.LayerNorm", 1e-12)
    out = h[:, 0]
    for index in (0, 2, 4, 6, 7):
        out = _lin(out, s, f"mlp.layers.{index}")
    return (out.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    from transformers import BertTokenizer

    folder = tmp_path_factory.mktemp("image_reward")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == 5 + len(WORDS)
    state = tiny_image_reward_state(len(tokenizer) + 2)  # BLIP adds [DEC] and [ENC]
    torch.save(state, folder / "ImageReward.pt")
    return folder, state, tokenizer


def test_image_reward_equals_an_independent_forward_in_any_batch_size(reward_folder):
    folder, state, tokenizer = reward_folder
    images = np.random.default_rng(2).integers(0, 256, (3, 3, 48, 40), dtype=np.uint8)
    options = {"model_path": str(folder), "head_width": HEAD}
    scores = build_reward({"name": "image_reward", "options": options})(images, PROMPTS, [{}] * 3)
    with torch.no_grad():
        pixels = preprocess_images(torch.from_numpy(images), PATCH * GRID, CLIP_MEAN, CLIP_STD)
        tokens = tokenizer(PROMPTS, padding="max_length", max_length=35, return_tensors="pt")
        expected = reference_scores(state, pixels, tokens["input_ids"], tokens["attention_mask"]).double().numpy()
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert np.ptp(scores) > 1e-3
    one_by_one = build_reward({"name": "image_reward", "options": {**options, "batch_size": 1}})
    np.testing.assert_allclose(one_by_one(images, PROMPTS, [{}] * 3), scores, atol=1e-6)


def test_an_incomplete_folder_names_the_files_it_lacks(reward_folder, tmp_path):
    with pytest.raises(ValueError, match=r"lacks the checkpoint ImageReward.pt and a BERT tokenizer \(vocab.txt"):
        build_reward({"name": "image_reward", "options": {"model_path": str(tmp_path)}})
    torch.save({"mlp.layers.0.weight": torch.zeros(1, 1)}, tmp_path / "ImageReward.pt")
    (tmp_path / "vocab.txt").write_text((reward_folder[0] / "vocab.txt").read_text())
    with pytest.raises(ValueError, match="is not an ImageReward state dict"):
        build_reward({"name": "image_reward", "options": {"model_path": str(tmp_path)}})
