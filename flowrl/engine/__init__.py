"""The diffusion rollout engine: continuous batching at denoising-step granularity.

Public names: `DiffusionEngine`, `EngineClosedError`, `SamplingParams` (re-exported from
`flowrl.sampling_params`, its home), `DiffusionOutput`.
"""

from flowrl.engine.output import DiffusionOutput
from flowrl.sampling_params import SamplingParams

__all__ = ["DiffusionEngine", "EngineClosedError", "SamplingParams", "DiffusionOutput"]


def __getattr__(name):
    # The engine imports diffusers and the model code; `import flowrl.engine` loads them on first use.
    if name == "DiffusionEngine":
        from flowrl.engine.engine import DiffusionEngine

        return DiffusionEngine
    if name == "EngineClosedError":
        from flowrl.engine.api import EngineClosedError

        return EngineClosedError
    raise AttributeError(name)
