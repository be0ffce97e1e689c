"""flowrl: online RL (FlowGRPO) for flow-matching text-to-image models.

The package is organised around a rollout engine that batches diffusion generation itself
(`flowrl.engine`), model adapters over diffusers modules (`flowrl.models`), one sampler function
shared by rollout and training (`flowrl.sampler`), an agent loop that turns dataset rows into
rollouts (`flowrl.rollout`), rewards (`flowrl.rewards`) and the FlowGRPO trainer (`flowrl.trainer`).
Heavy imports (torch, diffusers) happen in the submodules, never here.
"""

__version__ = "0.1.0"
