"""Training scored by a VLM judge (the stand-in of chat_standin.py on 127.0.0.1): three steps run,
and with a judge of 50 ms per image a step waits for about one answer, not its batch's (scoring
overlaps generation; reward.num_workers above 1 lets the last group start while an earlier one is
still being judged)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from chat_standin import standin_server


def test_three_steps_scored_by_a_judge_that_is_fast_enough_not_to_wait_for(build_trainer, make_cfg):
    with standin_server(delay_s=0.05) as (standin, url):
        cfg = make_cfg(
            "trainer.total_steps=3",
            "trainer.prompts_per_step=2",
            "rollout.n=4",
            "reward.name=vlm",
            f"reward.options.url={url}",
            "reward.options.model=judge",
            "reward.options.max_concurrency=16",
            "reward.num_workers=4",
        )
        summary = build_trainer(cfg).fit()
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    rows_per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
    assert len(standin.bodies) == 3 * rows_per_step
    assert all(np.isfinite(r["reward/mean"]) and r["reward/nan_ratio"] == 0 for r in steps)
    # The last rows to finish are judged after the rollout, so a step waits about one answer
    # (50 ms), not the 0.4 s of its 8 rows judged one by one; step 1 also opens the connections.
    waits = [r["timing/reward_wait_s"] for r in steps]
    assert max(waits[1:]) < 0.2, waits
    assert standin.max_in_flight > 1  # requests overlapped
