"""The algorithms and nothing else: the step (trainer.py, its phases in order), the step's samples
(rollout.py), the seam every algorithm implements and the registry that names them (algorithm.py),
FlowGRPO (flow_grpo.py) with its update (update.py, plan.py), loss (loss.py) and advantages
(advantages.py), where each log-prob's value comes from (logprob.py), the recompute scored while
rewards are computed (early_denominators.py), gradient checkpointing's choice
(grad_checkpointing.py) and the moving average of the weights (ema.py).

`Trainer` (trainer.py) is imported lazily, so light modules (advantages, loss) stay cheap.
"""

__all__ = ["Trainer"]


def __getattr__(name):
    if name == "Trainer":
        from flowrl.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'flowrl.trainer' has no attribute {name!r}")
