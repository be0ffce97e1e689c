"""`hpsv2` on a tiny random OpenCLIP checkpoint built in the test: its score equals the cosine an
independent OpenCLIP-style forward (written here from OpenCLIP's architecture) gives, in any batch
size and run after run; an incomplete folder is named with the files it lacks.

OpenCLIP itself needs torchvision, which does not install beside this CPU torch, so the reference
is this file's forward, not the package's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.models.debug.tiny_tokenizers import build_clip_tokenizer
from flowrl.rewards import build_reward
from flowrl.rewards.clip_scores import CLIP_MEAN, CLIP_STD, preprocess_images

TEXT_WIDTH, VISION_WIDTH, HEAD_WIDTH, EMBED, PATCH, GRID, CONTEXT = 32, 48, 16, 24, 8, 4, 77
PROMPTS = ["a red car", "a photo of a dog", "a blue sign on the street"]


def _blocks(prefix: str, width: int, depth: int, generator) -> dict:
    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=generator) * scale

    state = {}
    for i in range(depth):
        p = f"{prefix}{i}."
        state |= {
            p + "ln_1.weight": 1 + rand(width),
            p + "ln_1.bias": rand(width),
            p + "attn.in_proj_weight": rand(3 * width, width, scale=width**-0.5),
            p + "attn.in_proj_bias": rand(3 * width),
            p + "attn.out_proj.weight": rand(width, width, scale=width**-0.5),
            p + "attn.out_proj.bias": rand(width),
            p + "ln_2.weight": 1 + rand(width),
            p + "ln_2.bias": rand(width),
            p + "mlp.c_fc.weight": rand(4 * width, width, scale=width**-0.5),
            p + "mlp.c_fc.bias": rand(4 * width),
            p + "mlp.c_proj.weight": rand(width, 4 * width, scale=(4 * width) ** -0.5),
            p + "mlp.c_proj.bias": rand(width),
        }
    return state


def tiny_open_clip_state(vocab_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {
        "logit_scale": torch.tensor(math.log(100.0)),
        "token_embedding.weight": torch.randn(vocab_size, TEXT_WIDTH, generator=g) * 0.1,
        "positional_embedding": torch.randn(CONTEXT, TEXT_WIDTH, generator=g) * 0.1,
        "ln_final.weight": torch.ones(TEXT_WIDTH),
        "ln_final.bias": torch.zeros(TEXT_WIDTH),
        "text_projection": torch.randn(TEXT_WIDTH, EMBED, generator=g) * TEXT_WIDTH**-0.5,
        "visual.class_embedding": torch.randn(VISION_WIDTH, generator=g) * 0.1,
        "visual.conv1.weight": torch.randn(VISION_WIDTH, 3, PATCH, PATCH, generator=g) * 0.05,
        "visual.positional_embedding": torch.randn(GRID * GRID + 1, VISION_WIDTH, generator=g) * 0.1,
        "visual.ln_pre.weight": torch.ones(VISION_WIDTH),
        "visual.ln_pre.bias": torch.zeros(VISION_WIDTH),
        "visual.ln_post.weight": torch.ones(VISION_WIDTH),
        "visual.ln_post.bias": torch.zeros(VISION_WIDTH),
        "visual.proj": torch.randn(VISION_WIDTH, EMBED, generator=g) * VISION_WIDTH**-0.5,
    }
    state |= _blocks("transformer.resblocks.", TEXT_WIDTH, 2, g)
    state |= _blocks("visual.transformer.resblocks.", VISION_WIDTH, 2, g)
    return state


# --- the reference: OpenCLIP's forward, written out -----------------------------------------------
def _layer_norm(x, state, name):
    return F.layer_norm(x, x.shape[-1:], state[name + ".weight"], state[name + ".bias"], eps=1e-5)


def _residual_block(x, state, p, mask):
    h = _layer_norm(x, state, p + "ln_1")
    q, k, v = (h @ state[p + "attn.in_proj_weight"].t() + state[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
    heads = x.shape[-1] // HEAD_WIDTH
    split = lambda t: t.view(*t.shape[:2], heads, HEAD_WIDTH).transpose(1, 2)
    weights = (split(q) @ split(k).transpose(-1, -2)) / math.sqrt(HEAD_WIDTH) + mask
    attended = (weights.softmax(-1) @ split(v)).transpose(1, 2).reshape(x.shape)
    x = x + attended @ state[p + "attn.out_proj.weight"].t() + state[p + "attn.out_proj.bias"]
    h = F.gelu(_layer_norm(x, state, p + "ln_2") @ state[p + "mlp.c_fc.weight"].t() + state[p + "mlp.c_fc.bias"])
    return x + h @ state[p + "mlp.c_proj.weight"].t() + state[p + "mlp.c_proj.bias"]


def reference_image_features(state, pixels):
    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = (
        torch.cat([state["visual.class_embedding"].expand(len(x), 1, -1), x], dim=1)
        + state["visual.positional_embedding"]
    )
    x = _layer_norm(x, state, "visual.ln_pre")
    for i in range(2):
        x = _residual_block(x, state, f"visual.transformer.resblocks.{i}.", 0.0)
    return _layer_norm(x[:, 0], state, "visual.ln_post") @ state["visual.proj"]


def reference_text_features(state, ids, eos_id):
    x = state["token_embedding.weight"][ids] + state["positional_embedding"][: ids.shape[1]]
    causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)
    for i in range(2):
        x = _residual_block(x, state, f"transformer.resblocks.{i}.", causal)
    x = _layer_norm(x, state, "ln_final")
    end = (ids == eos_id).int().argmax(-1)  # the end-of-text token (OpenCLIP: the highest id, the same token)
    return x[torch.arange(len(ids)), end] @ state["text_projection"]


@pytest.fixture(scope="module")
def hps_folder(tmp_path_factory):
    tokenizer = build_clip_tokenizer()
    assert len(tokenizer) > 500
    folder = tmp_path_factory.mktemp("hps")
    state = tiny_open_clip_state(len(tokenizer))
    torch.save({"state_dict": {"module." + k: v for k, v in state.items()}}, folder / "HPS_v2.1_compressed.pt")
    tokenizer.save_pretrained(folder)
    return folder, state, tokenizer


def test_hps_equals_an_independent_open_clip_forward_in_any_batch_size(hps_folder):
    folder, state, tokenizer = hps_folder
    images = np.random.default_rng(1).integers(0, 256, (3, 3, 40, 48), dtype=np.uint8)
    reward = build_reward(
        {
            "name": "hpsv2",
            "options": {"model_path": str(folder), "vision_head_width": HEAD_WIDTH, "text_head_width": HEAD_WIDTH},
        }
    )
    scores = reward(images, PROMPTS, [{}] * 3)
    with torch.no_grad():
        pixels = preprocess_images(torch.from_numpy(images), PATCH * GRID, CLIP_MEAN, CLIP_STD)
        ids = torch.tensor([tokenizer(p, padding="max_length", max_length=CONTEXT)["input_ids"] for p in PROMPTS])
        image = F.normalize(reference_image_features(state, pixels), dim=-1)
        text = F.normalize(reference_text_features(state, ids, tokenizer.eos_token_id), dim=-1)
    expected = (image * text).sum(-1).double().numpy()
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert np.ptp(scores) > 1e-3  # the rows differ: a broken conversion would not match by chance
    one_by_one = build_reward(
        {
            "name": "hpsv2",
            "options": {
                "model_path": str(folder),
                "batch_size": 1,
                "vision_head_width": HEAD_WIDTH,
                "text_head_width": HEAD_WIDTH,
            },
        }
    )
    np.testing.assert_allclose(one_by_one(images, PROMPTS, [{}] * 3), scores, atol=1e-6)
    np.testing.assert_array_equal(reward(images, PROMPTS, [{}] * 3), scores)


def test_an_incomplete_folder_names_the_files_it_lacks(hps_folder, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"lacks the checkpoint \(HPS_v2.1_compressed.pt or HPS_v2_compressed.pt\) and a CLIP tokenizer",
    ):
        build_reward({"name": "hpsv2", "options": {"model_path": str(tmp_path)}})
    hps_folder[2].save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"lacks the checkpoint") as caught:
        build_reward({"name": "hpsv2", "options": {"model_path": str(tmp_path)}})
    assert "tokenizer" not in str(caught.value).split("lacks")[1].split(";")[0]
    torch.save({"state_dict": {"visual.proj": torch.zeros(2, 2)}}, tmp_path / "HPS_v2_compressed.pt")
    with pytest.raises(ValueError, match="not an OpenCLIP CLIP state dict"):
        build_reward({"name": "hpsv2", "options": {"model_path": str(tmp_path)}})


@pytest.mark.parametrize("height, width", [(512, 768), (300, 200), (64, 64)])
def test_preprocessing_matches_the_reference_pipeline_up_to_uint8_rounding(height, width):
    """HPS v2 (OpenCLIP) and ImageReward (BLIP) preprocess with torchvision's Resize(short side,
    bicubic) and CenterCrop on a PIL image; torchvision does not import here, so its steps are
    reproduced with PIL (which it calls): the long side truncated, the crop offset rounded."""
    from PIL import Image

    size = 224
    coarse = np.random.default_rng(0).integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))
    ours = preprocess_images(torch.from_numpy(image.transpose(2, 0, 1)[None].copy()), size, CLIP_MEAN, CLIP_STD)[0]
    scale = size / min(height, width)
    new_w, new_h = (size, int(height * scale)) if width <= height else (int(width * scale), size)
    resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.BICUBIC))
    top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
    crop = torch.from_numpy(resized[top : top + size, left : left + size].astype(np.float32) / 255).permute(2, 0, 1)
    reference = (crop - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]
    levels = ((ours - reference).abs() * torch.tensor(CLIP_STD)[:, None, None] * 255).numpy()
    assert levels.max() < 1.5 and levels.mean() < 0.4  # PIL rounds to uint8 (0.25 on average); the rest agrees
