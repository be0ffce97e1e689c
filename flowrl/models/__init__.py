"""Model adapters over diffusers modules, one per family, behind one interface.

`load_adapter(path, device, dtype)` reads `model_index.json` of a local diffusers folder and returns
the matching adapter (`SD3Adapter`, `QwenImageAdapter`, `FluxAdapter` or `ZImageAdapter`; the list of families is
flowrl.models.registry). `flowrl.models.debug.tiny` builds tiny random checkpoints offline for tests and
the CPU demo. Nothing here compiles or holds kernels: that is flowrl.accel.
"""

from flowrl.models.base import FlowModelAdapter, PromptEncoding
from flowrl.models.registry import load_adapter, read_model_family

__all__ = ["FlowModelAdapter", "PromptEncoding", "load_adapter", "read_model_family"]
