"""`hpsv3` on a tiny random Qwen2-VL with an HPS v3 head, saved in the released layout: its score
equals an independent forward (the reference's path: chat template and Qwen2VLProcessor build the
input, transformers' Qwen2VLForConditionalGeneration runs it, the head reads the hidden state at
`<|Reward|>`), in any batch size; an incomplete folder is named with the files it lacks; the
reward is reachable through build_reward and `flowrl reward-score`.

The hpsv3 package needs qwen_vl_utils and the 7B weights, so the reference is this file's forward."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowrl.models.debug.tiny_tokenizers import COMMON_WORDS, build_qwen2_tokenizer
from flowrl.rewards import build_reward
from flowrl.rewards.hpsv3 import backbone_state, load_template, smart_resize

PROMPTS = ["a red car", "a photo of a dog on the street with a blue sign", "a cat"]
PIXELS = 4 * 28 * 28  # small images for the tiny vision tower: 40 x 60 -> 56 x 84
# Qwen2-VL-7B-Instruct's chat template (its chat_template.json), written out.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _instruction() -> str:
    """The user text of the template (HPS v3's INSTRUCTION + reward suffix)."""
    return load_template().split("<|vision_end|>")[1].split("<|im_end|>")[0]


def tiny_config(tokenizer, vocab_size: int):
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=ids("<|im_end|>"),
        ),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, mlp_ratio=2, hidden_size=32, patch_size=14),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def tiny_head(hidden: int) -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, 1024),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.05),
        torch.nn.Linear(1024, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    ).eval()


@pytest.fixture(scope="module")
def hpsv3_folder(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    words = set(COMMON_WORDS) | set(re.findall(r"[A-Za-z]+", _instruction()))
    tokenizer = build_qwen2_tokenizer(tuple(sorted(words)))
    folder = tmp_path_factory.mktemp("hpsv3")
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    config = tiny_config(tokenizer, len(tokenizer) + 1)  # + <|Reward|>, which the reward adds
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if "norm" in name else 0.0))
    head = tiny_head(config.text_config.hidden_size)
    state = model.state_dict() | {f"rm_head.{k}": v for k, v in head.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "HPSv3.safetensors"))
    return folder, model, head


def _images(count: int = 3) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (count, 3, 40, 60), dtype=np.uint8)


def reference_scores(folder, model, head, images, prompts) -> np.ndarray:
    """The reference's path in one right-padded batch: qwen_vl_utils' resize, the chat template, the
    image processor, Qwen2VLProcessor's image-token expansion (done here: its video half needs
    torchvision), the model, the head at `<|Reward|>`."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    pil = [Image.fromarray(image.transpose(1, 2, 0)).resize((84, 56), Image.BICUBIC) for image in images]
    vision = Qwen2VLImageProcessorPil.from_pretrained(str(folder))(images=pil, return_tensors="pt")
    texts = []
    for prompt, grid in zip(prompts, vision["image_grid_thw"]):
        content = [{"type": "image"}, {"type": "text", "text": _instruction().replace("{text_prompt}", prompt)}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
        )
        texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4)))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    if len(set(prompts)) > 1:
        assert batch["input_ids"][:, -1].eq(tokenizer.pad_token_id).any()  # padded on the right
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        hidden = model(
            **batch,
            **vision,
            mm_token_type_ids=(batch["input_ids"] == image_id).int(),
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states[-1]
        pooled = hidden[batch["input_ids"] == tokenizer.convert_tokens_to_ids("<|Reward|>")]  # one per row
        return head(pooled)[:, 0].double().numpy()


def test_smart_resize_gives_the_references_sizes():
    assert smart_resize(1024, 1024) == (448, 448) and smart_resize(512, 512) == (448, 448)
    assert smart_resize(40, 60, 28, PIXELS, PIXELS) == (56, 84)
    assert smart_resize(768, 1344) == (336, 588)  # 200704 pixels at most, both sides multiples of 28


def test_the_template_is_the_chat_rendered_instruction_with_its_whitespace():
    template = load_template()
    assert template.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert template.endswith(
        "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "the best. \n\n**Visual Quality:**  \n" in template and "**Text Alignment:**  \n" in template
    assert "Textual prompt - {text_prompt}\n\n\n\nPlease" in template
    assert template.count("{text_prompt}") == 1 and template.count("<|image_pad|>") == 1


def test_hpsv3_equals_an_independent_forward_in_any_batch_size(hpsv3_folder):
    folder, model, head = hpsv3_folder
    images = _images()
    options = {"model_path": str(folder), "dtype": "float32", "pixels": PIXELS}
    reward = build_reward({"name": "hpsv3", "options": options})
    scores = reward(images, PROMPTS, [{}] * 3)
    expected = reference_scores(folder, model, head, images, PROMPTS)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert np.ptp(scores) > 1e-3  # the rows differ: a wrong position would not match by chance
    one_by_one = build_reward({"name": "hpsv3", "options": options | {"batch_size": 1}})
    np.testing.assert_allclose(one_by_one(images, PROMPTS, [{}] * 3), scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(reward(images, PROMPTS, [{}] * 3), scores)


def test_an_incomplete_folder_names_the_files_it_lacks(hpsv3_folder, tmp_path):
    with pytest.raises(ValueError, match=r"lacks the checkpoint HPSv3.safetensors and .*config.json and .*tokenizer"):
        build_reward({"name": "hpsv3", "options": {"model_path": str(tmp_path)}})
    for name in ("config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hpsv3_folder[0] / name).read_bytes())
    with pytest.raises(ValueError, match=r"lacks the checkpoint HPSv3.safetensors;") as caught:
        build_reward({"name": "hpsv3", "options": {"model_path": str(tmp_path)}})
    assert "tokenizer" not in str(caught.value).split("lacks")[1].split(";")[0]
    save_file({"rm_head.0.weight": torch.zeros(2, 2)}, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match="does not fit Qwen2-VL with an HPS v3 head"):
        build_reward({"name": "hpsv3", "options": {"model_path": str(tmp_path)}})


def test_reward_score_cli_scores_files_with_hpsv3(hpsv3_folder, tmp_path, capsys):
    from flowrl.cli import main

    folder, model, head = hpsv3_folder
    images = _images(2)
    files = []
    for index, image in enumerate(images):
        files.append(str(tmp_path / f"{index}.png"))
        Image.fromarray(image.transpose(1, 2, 0)).save(files[-1])
    options = ["--option", f"model_path={folder}", "--option", "dtype=float32", "--option", f"pixels={PIXELS}"]
    assert main(["reward-score", "--reward", "hpsv3", *options, "--prompt", "a red car", *files]) == 0
    printed = [float(line.split()[-1]) for line in capsys.readouterr().out.split("\n") if line.strip()]
    np.testing.assert_allclose(printed, reference_scores(folder, model, head, images, ["a red car"] * 2), atol=1e-4)


def test_both_transformers_key_layouts_map_to_the_same_backbone():
    w = torch.zeros(1)
    new = {"model.language_model.norm.weight": w, "model.visual.merger.ln_q.weight": w, "lm_head.weight": w}
    old = {"model.norm.weight": w, "visual.merger.ln_q.weight": w, "lm_head.weight": w}
    head = {"rm_head.0.weight": w}
    for state in (new, old):
        backbone, rm_head = backbone_state(state | head)
        assert set(backbone) == {"language_model.norm.weight", "visual.merger.ln_q.weight"}
        assert set(rm_head) == {"0.weight"}
    with pytest.raises(KeyError, match="unexpected key 'score.weight'"):
        backbone_state({"score.weight": w})
