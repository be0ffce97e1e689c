"""FlowGRPO training: group advantages, the clipped PPO loss over stored SDE transitions, LoRA or
full fine-tuning, checkpoints, logging, and the colocated training loop (`flowrl train`).

`FlowGRPOTrainer` (trainer.py) is imported lazily so light modules (advantages, loss, data) stay
cheap to import.
"""

__all__ = ["FlowGRPOTrainer"]


def __getattr__(name):
    if name == "FlowGRPOTrainer":
        from flowrl.trainer.trainer import FlowGRPOTrainer

        return FlowGRPOTrainer
    raise AttributeError(f"module 'flowrl.trainer' has no attribute {name!r}")
