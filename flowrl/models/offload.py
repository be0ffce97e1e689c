"""Text encoders kept on the CPU (`model.offload_text_encoders`): their weights stream to the GPU
layer by layer while prompts are encoded and leave it after (accelerate's `cpu_offload` hooks), so
the GPU memory they held (Qwen-Image's 8.3 B-parameter encoder: about 17 GB in bf16) serves the
rollout and the update. The cost is one host-to-device copy of the encoders' weights per batch of
prompts encoded: the engine encodes a prompt once and caches its encoding (its prompt cache), so
a training step copies them once for its new prompts.
"""

from __future__ import annotations

import torch

# The pipeline components that are text encoders, in every family flowrl loads.
TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def offload_text_encoders(adapter) -> list[str]:
    """Move the adapter's text encoders to the CPU behind hooks that run them on `adapter.device`;
    returns their component names. The encodings are the same values (the same modules and
    weights, run on the same device)."""
    from accelerate import cpu_offload

    names = [name for name in TEXT_ENCODER_COMPONENTS if getattr(adapter.pipeline, name, None) is not None]
    if not names:
        raise ValueError("model.offload_text_encoders=true, but the model has no text encoder to offload; set it false")
    for name in names:
        module = getattr(adapter.pipeline, name)
        module.to("cpu")
        cpu_offload(module, execution_device=torch.device(adapter.device))
    if torch.device(adapter.device).type == "cuda":
        torch.cuda.empty_cache()  # the encoders' memory back to the device, not held by the allocator
    return names
