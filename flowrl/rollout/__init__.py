"""Rollout: dataset rows -> samples through the engine.

`RolloutBatch` (batch.py) holds rows and their samples. `AgentLoop` (agent_loop.py, written
separately) drives the engine; it is imported lazily so `from flowrl.rollout import RolloutBatch`
stays light.
"""

from flowrl.rollout.batch import RolloutBatch, stack_rows

__all__ = ["AgentLoop", "RolloutBatch", "stack_rows"]


def __getattr__(name):
    # AgentLoop is exported from agent_loop.py; imported on first use only.
    if name == "AgentLoop":
        from flowrl.rollout.agent_loop import AgentLoop

        return AgentLoop
    raise AttributeError(f"module 'flowrl.rollout' has no attribute {name!r}")
