"""Model adapters over diffusers modules, one per family, behind one interface.

`load_adapter(path, device, dtype)` reads `model_index.json` of a local diffusers folder and returns
the matching adapter (`SD3Adapter` or `QwenImageAdapter`). `flowrl.models.tiny` builds tiny random
checkpoints offline for tests and the CPU demo.
"""

from flowrl.models.base import FlowModelAdapter, PromptEncoding, load_adapter

__all__ = ["FlowModelAdapter", "PromptEncoding", "load_adapter"]
