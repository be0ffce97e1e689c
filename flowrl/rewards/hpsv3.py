"""`hpsv3`: Human Preference Score v3 (ICCV 2025) from its released checkpoint in a local folder.

HPS v3 is Qwen2-VL-7B-Instruct with a reward head. The model reads one chat turn: the image, then
a fixed instruction that quotes the caption and ends in an added special token, `<|Reward|>`. The
decoder's last hidden state (after the final norm) at that token goes through the head,
Linear(hidden, 1024) - ReLU - Dropout - Linear(1024, 16) - ReLU - Linear(16, 2), which gives
(mu, sigma); the score is mu. The head runs in float32 whatever `dtype` the backbone has.

The folder holds:
- `HPSv3.safetensors`, the released checkpoint (the HF repo MizzenAI/HPSv3). It is the whole
  model's state dict, base weights included (the reference loads it with strict=True over a model
  built from Qwen2-VL-7B-Instruct), so Qwen2-VL's own weight files are not needed. Keys:
  `model.language_model.*` and `model.visual.*` (transformers >= 4.52's layout; the older
  `model.*` / `visual.*` is accepted too), `lm_head.weight` (unused here) and `rm_head.{0,3,5}.*`.
  Its token embedding has one row per token of the tokenizer below after `<|Reward|>` is added.
- Qwen2-VL-7B-Instruct's `config.json`, `preprocessor_config.json` and tokenizer (`tokenizer.json`,
  or `vocab.json` + `merges.txt`, with `tokenizer_config.json`).

The input is judge_templates/hpsv3.txt: the text Qwen2-VL-7B-Instruct's chat template renders for
one user turn (image, then the instruction; default system message; generation prompt added),
with HPS v3's instruction and reward suffix as the reference (hpsv3/dataset/data_collator_qwen.py
and hpsv3/inference.py) defines them, whitespace included. `{text_prompt}` is the caption;
`<|image_pad|>` is repeated once per merged image token, as Qwen2VLProcessor does. Images are
resized as the reference does through qwen_vl_utils: both sides rounded to multiples of 28 with
min_pixels = max_pixels = 256 * 28 * 28 (a square image becomes 448 x 448), PIL bicubic on uint8,
then Qwen2-VL's image processor (rescale, CLIP mean and std, patches) without a second resize.
Sequences are padded on the right, as the reference does; the token's hidden state does not see
the padding, so a row's score does not depend on its batch.

Not established from the reference: the official repository's data_collator_qwen.py was not
readable here (its stored copy holds inference.py, train.py, the model and the config, not the
dataset code); the instruction was taken from copies of that file. Two agree (an unmodified-looking
copy of the file and a re-implementation's utils.py), with both the "Visual Quality" and "Text
Alignment" sections; a fork (HPSv3-PlusPlus) and one copy labelled "upstream" keep only the first,
so which text the released weights were trained with is not certain. The released checkpoint's
exact key layout (new or old transformers naming) could not be opened offline (MizzenAI/HPSv3
issue 29 reports a strict-load key mismatch with the official code), so both are accepted. A caption that itself contains `<|Reward|>` is not guarded against by the
reference; here the template's (last) occurrence is read.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import torch

from flowrl.rewards.base import Reward
from flowrl.rewards.clip_scores import _DTYPES, _check_batch_size, _existing_path

CHECKPOINT_NAME = "HPSv3.safetensors"
REWARD_TOKEN = "<|Reward|>"
IMAGE_TOKEN = "<|image_pad|>"
PIXELS = 256 * 28 * 28  # the reference's min_pixels and max_pixels
TEMPLATE_PATH = Path(__file__).parent / "judge_templates" / "hpsv3.txt"
HEAD_LAYERS = (0, 3, 5)  # the Linear layers of rm_head (nn.Sequential indices)


def load_template() -> str:
    with open(TEMPLATE_PATH, encoding="utf-8", newline="") as handle:
        return handle.read()


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = PIXELS, max_pixels: int = PIXELS):
    """Qwen2-VL's target size: sides rounded to multiples of `factor`, area within [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"hpsv3: an image of {height} x {width} is too elongated (aspect ratio over 200)")
    h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_images(images: np.ndarray, factor: int, pixels: int) -> list[np.ndarray]:
    """(B, 3, H, W) uint8 -> HWC uint8 arrays at Qwen2-VL's size, PIL bicubic (qwen_vl_utils' resize)."""
    from PIL import Image

    out = []
    for image in images:
        height, width = image.shape[1:]
        new_h, new_w = smart_resize(height, width, factor, pixels, pixels)
        pil = Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0)))
        out.append(np.asarray(pil.resize((new_w, new_h), Image.BICUBIC)))
    return out


def backbone_state(state: dict) -> tuple[dict, dict]:
    """The checkpoint -> (Qwen2VLModel state dict, rm_head state dict); lm_head is dropped."""
    backbone, head = {}, {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith(("model.language_model.", "model.visual.")):
            backbone[key.removeprefix("model.")] = value
        elif key.startswith("visual."):  # transformers < 4.52
            backbone[key] = value
        elif key.startswith("model."):
            backbone["language_model." + key.removeprefix("model.")] = value
        elif not key.startswith("lm_head."):
            raise KeyError(f"unexpected key {key!r}")
    return backbone, head


def _missing_files(folder: Path) -> list[str]:
    missing = [] if (folder / CHECKPOINT_NAME).is_file() else [f"the checkpoint {CHECKPOINT_NAME}"]
    for name in ("config.json", "preprocessor_config.json"):
        if not (folder / name).is_file():
            missing.append(f"Qwen2-VL-7B-Instruct's {name}")
    if not ((folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))):
        missing.append("Qwen2-VL-7B-Instruct's tokenizer (tokenizer.json, or vocab.json and merges.txt)")
    return missing


class HpsV3Reward(Reward):
    name = "hpsv3"

    def __init__(
        self,
        model_path: str,
        batch_size: int = 8,
        device: str = "cpu",
        dtype: str = "bfloat16",
        pixels: int = PIXELS,
    ):
        from accelerate import init_empty_weights
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLModel
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        folder = _existing_path("model_path", model_path, self.name, want_dir=True)
        if dtype not in _DTYPES:
            raise ValueError(f"hpsv3 option dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        self.batch_size = _check_batch_size(self.name, batch_size)
        if not isinstance(pixels, int) or isinstance(pixels, bool) or pixels < 28 * 28:
            raise ValueError(f"hpsv3 option pixels={pixels!r} must be an integer of at least 784 (28 x 28)")
        self.pixels = pixels
        missing = _missing_files(folder)
        if missing:
            raise ValueError(
                f"hpsv3 option model_path={str(model_path)!r} is incomplete: it lacks {' and '.join(missing)}; "
                f"put the released {CHECKPOINT_NAME} (MizzenAI/HPSv3) and Qwen2-VL-7B-Instruct's config, "
                "preprocessor and tokenizer files (not its weights) in it"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"hpsv3: the tokenizer in {folder} has no pad token (Qwen2-VL's is <|endoftext|>)")
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
        self.factor = int(self.image_processor.patch_size) * int(self.image_processor.merge_size)
        config = Qwen2VLConfig.from_pretrained(str(folder))
        try:
            backbone, head = backbone_state(load_file(str(folder / CHECKPOINT_NAME)))
            rows, hidden = backbone["language_model.embed_tokens.weight"].shape
            if rows != len(self.tokenizer):
                raise ValueError(
                    f"its token embedding has {rows} rows but the tokenizer with {REWARD_TOKEN} has "
                    f"{len(self.tokenizer)} tokens; use Qwen2-VL-7B-Instruct's tokenizer"
                )
            config.text_config.vocab_size = rows
            with init_empty_weights(include_buffers=False):
                model = Qwen2VLModel(config)
            model.load_state_dict(backbone, strict=True, assign=True)
            self.head = [(head[f"{i}.weight"].float(), head[f"{i}.bias"].float()) for i in HEAD_LAYERS]
            if self.head[0][0].shape[1] != hidden or self.head[-1][0].shape[0] != 2:
                raise ValueError(f"rm_head must map {hidden} features to 2 (mu, sigma)")
        except (KeyError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"hpsv3: {folder / CHECKPOINT_NAME} does not fit Qwen2-VL with an HPS v3 head "
                f"({type(error).__name__}: {error}); use the released {CHECKPOINT_NAME} with "
                "Qwen2-VL-7B-Instruct's config and tokenizer"
            ) from None
        if config.image_token_id != self.image_id:
            raise ValueError(f"hpsv3: config.json's image_token_id {config.image_token_id} is not {IMAGE_TOKEN}'s")
        self.device = torch.device(device)
        self.model = model.to(self.device, _DTYPES[dtype]).eval().requires_grad_(False)
        self.head = [(w.to(self.device), b.to(self.device)) for w, b in self.head]
        self.template = load_template()

    def _texts(self, prompts, grid_thw: torch.Tensor) -> list[list[int]]:
        merge = int(self.image_processor.merge_size) ** 2
        ids = []
        for prompt, grid in zip(prompts, grid_thw):
            text = self.template.replace(IMAGE_TOKEN, IMAGE_TOKEN * (int(grid.prod()) // merge), 1)
            ids.append(self.tokenizer(text.replace("{text_prompt}", prompt, 1))["input_ids"])
        return ids

    def _token_types(self, input_ids: torch.Tensor) -> dict:
        """transformers >= 5.x places M-RoPE by token type: 0 text, 1 image (what its processor returns)."""
        if "mm_token_type_ids" not in inspect.signature(self.model.forward).parameters:
            return {}
        return {"mm_token_type_ids": (input_ids == self.image_id).int().to(self.device)}

    @torch.inference_mode()
    def _score_chunk(self, images, prompts) -> torch.Tensor:
        vision = self.image_processor(
            images=resize_images(images, self.factor, self.pixels), do_resize=False, return_tensors="pt"
        )
        ids = self._texts(prompts, vision["image_grid_thw"])
        length = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), length), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)], attention_mask[i, : len(row)] = torch.tensor(row), 1
        hidden = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            pixel_values=vision["pixel_values"].to(self.device, self.model.dtype),
            image_grid_thw=vision["image_grid_thw"].to(self.device),
            use_cache=False,
            **self._token_types(input_ids),
        ).last_hidden_state
        is_reward = input_ids == self.reward_id
        if not is_reward.any(-1).all():
            raise ValueError(f"hpsv3: {REWARD_TOKEN} is not a single token for this tokenizer")
        position = length - 1 - is_reward.flip(-1).int().argmax(-1)  # the last one: the template's
        features = hidden[torch.arange(len(ids)), position.to(self.device)].float()
        for index, (weight, bias) in enumerate(self.head):
            features = torch.nn.functional.linear(features, weight, bias)
            if index < len(self.head) - 1:
                features = torch.relu(features)  # the dropout between is off at inference
        return features[:, 0].cpu()  # (mu, sigma) -> mu

    def score_batch(self, images, prompts, metadata):
        chunks = [
            self._score_chunk(images[i : i + self.batch_size], prompts[i : i + self.batch_size])
            for i in range(0, len(prompts), self.batch_size)
        ]
        return torch.cat(chunks).double().numpy()
