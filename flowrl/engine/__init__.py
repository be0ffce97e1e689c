"""The diffusion rollout engine: continuous batching at denoising-step granularity.

Public names: `DiffusionEngine`, `SamplingParams`, `DiffusionOutput`.
"""

from flowrl.engine.output import DiffusionOutput
from flowrl.engine.request import SamplingParams

__all__ = ["DiffusionEngine", "SamplingParams", "DiffusionOutput"]


def __getattr__(name):
    # The engine imports torch and diffusers; keep `from flowrl.engine import SamplingParams` light.
    if name == "DiffusionEngine":
        from flowrl.engine.engine import DiffusionEngine

        return DiffusionEngine
    raise AttributeError(name)
