"""flowrl's command line for the distributed tests, with test-only hooks (`install_hooks`) chosen
by environment variables; run it as `torchrun ... tests/distributed/rank_entry.py train ...` or as
a plain script.

FLOWRL_TEST_RECORD=DIR   each training rollout's seeds, latents and log-probs to
                         DIR/rank<R>-rollout<K>.pt (K counts this process's training rollouts)
FLOWRL_TEST_FAIL=R:S:M   on rank R, at the start of training step S, on torchrun's first attempt
                         only: M=raise raises RuntimeError("injected failure ... (time T)", T
                         its wall-clock time), M=kill sends the process SIGKILL, M=term
                         sends it SIGTERM and goes on with the step (a stop signal to one rank)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch


def install_hooks(record_dir: str | None = None, fail: str | None = None, rank: int = 0) -> None:
    from flowrl.rollout.agent_loop import AgentLoop
    from flowrl.trainer.trainer import Trainer

    if record_dir:
        generate = AgentLoop.generate_sequences
        count = {"rollouts": 0}

        def recorded(self, batch, validation=False, **kwargs):
            out = generate(self, batch, validation=validation, **kwargs)
            if not validation:
                count["rollouts"] += 1
                Path(record_dir).mkdir(parents=True, exist_ok=True)
                torch.save(
                    {
                        "seeds": list(out.non_tensor_batch["seed"]),
                        "all_latents": out.batch["all_latents"],
                        "all_log_probs": out.batch["all_log_probs"],
                    },
                    Path(record_dir) / f"rank{rank}-rollout{count['rollouts']}.pt",
                )
            return out

        AgentLoop.generate_sequences = recorded
    if fail and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fail_rank, fail_step, mode = fail.split(":")
        train_step = Trainer.train_step

        def failing(self):
            if rank == int(fail_rank) and self.step + 1 == int(fail_step):
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "term":
                    os.kill(os.getpid(), signal.SIGTERM)
                    return train_step(self)
                raise RuntimeError(f"injected failure on rank {rank} at step {fail_step} (time {time.time():.3f})")
            return train_step(self)

        Trainer.train_step = failing


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from flowrl.cli import main
    from flowrl.distributed.launch import end_rank_process

    install_hooks(
        os.environ.get("FLOWRL_TEST_RECORD"), os.environ.get("FLOWRL_TEST_FAIL"), int(os.environ.get("RANK", "0"))
    )
    code = record(main)()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # as `python -m flowrl` ends a torchrun rank
        end_rank_process(code)
    sys.exit(code)
