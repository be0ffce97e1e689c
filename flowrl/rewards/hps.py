"""`hpsv2`: Human Preference Score v2 from its OpenCLIP checkpoint in a local folder.

HPS v2 (and v2.1) is an OpenCLIP ViT-H/14 fine-tuned on human preferences; its score is the cosine
of the image and prompt embeddings (times `scale`, 1 by default). The folder holds the checkpoint
as released (`HPS_v2.1_compressed.pt` or `HPS_v2_compressed.pt`: an OpenCLIP state dict, possibly
under "state_dict") and a CLIP tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`: the
files of any CLIP tokenizer, e.g. OpenCLIP ViT-H/14's). The weights are converted in memory
(flowrl.rewards.open_clip_weights); images are preprocessed as the CLIP rewards do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.rewards.clip_scores import ClipBackbone, ClipScoreReward, _existing_path

CHECKPOINT_NAMES = ("HPS_v2.1_compressed.pt", "HPS_v2_compressed.pt")


def _tokenizer_present(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))


class HpsV2Reward(ClipScoreReward):
    name = "hpsv2"

    def __init__(
        self,
        model_path: str,
        scale: float = 1.0,
        batch_size: int = 32,
        device: str = "cpu",
        dtype: str = "float32",
        vision_head_width: int = 80,
        text_head_width: int = 64,
    ):
        self.head_widths = (vision_head_width, text_head_width)
        super().__init__(model_path, scale, batch_size, device, dtype)

    def load_backbone(self, model_path, device: str, dtype: str) -> ClipBackbone:
        from transformers import CLIPTokenizer

        from flowrl.rewards.open_clip_weights import clip_from_open_clip

        folder = _existing_path("model_path", model_path, self.name, want_dir=True)
        checkpoints = [folder / name for name in CHECKPOINT_NAMES if (folder / name).is_file()]
        missing = [] if checkpoints else [f"the checkpoint ({' or '.join(CHECKPOINT_NAMES)})"]
        if not _tokenizer_present(folder):
            missing.append("a CLIP tokenizer (tokenizer.json, or vocab.json and merges.txt)")
        if missing:
            raise ValueError(
                f"hpsv2 option model_path={str(model_path)!r} is incomplete: it lacks {' and '.join(missing)}; "
                "put the released HPS v2 checkpoint and a CLIP tokenizer's files in it"
            )
        state = torch.load(checkpoints[0], map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        tokenizer = CLIPTokenizer.from_pretrained(str(folder))
        try:
            model = clip_from_open_clip(state, tokenizer.eos_token_id, *self.head_widths)
        except (KeyError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"hpsv2: {checkpoints[0]} is not an OpenCLIP CLIP state dict as HPS v2 ships ({type(error).__name__}: "
                f"{error}); use the released HPS_v2*_compressed.pt"
            ) from None
        return ClipBackbone(folder, self.name, device, dtype, model=model)
