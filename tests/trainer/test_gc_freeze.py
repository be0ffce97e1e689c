"""flowrl.trainer.gc_freeze: after its first step the trainer keeps the objects alive then out of
Python's full collections, and hands them back when it closes."""

from __future__ import annotations

import gc

from flowrl.trainer.gc_freeze import GcFreeze


def test_freezes_once_after_the_first_step_and_releases():
    gc.unfreeze()
    freeze = GcFreeze()
    kept = [object() for _ in range(10)]
    cycle: dict = {}
    cycle["self"] = cycle
    del cycle  # garbage before the freeze is collected, not frozen
    freeze.after_step()
    frozen = gc.get_freeze_count()
    assert freeze.is_frozen and frozen > 0
    later = [{"n": i} for i in range(1000)]  # made after the first step: not frozen by the next ones
    freeze.after_step()
    assert gc.get_freeze_count() == frozen
    freeze.release()
    assert not freeze.is_frozen and gc.get_freeze_count() == 0
    freeze.release()  # idempotent
    assert kept and later


def test_the_trainer_freezes_after_its_first_step_and_unfreezes_at_close(build_trainer, make_cfg):
    gc.unfreeze()
    trainer = build_trainer(make_cfg("trainer.total_steps=1"))
    assert gc.get_freeze_count() == 0
    trainer.train_step()
    assert gc.get_freeze_count() > 0
    trainer.close()
    assert gc.get_freeze_count() == 0
