"""Keep Python's cyclic garbage collector off the objects a run builds once.

The first training step compiles the model's graphs and builds the optimizer's states and the
caches the later steps reuse: most of the process's long-lived objects. A full collection
(generation 2) walks every tracked object, and it pauses the thread that triggered it: when that
is the thread launching GPU work (the engine's rollout thread, the update loop), the GPU runs out of
queued work and idles (`flowrl bench train` reports the pauses; docs/performance.md what they
cost). After the first step, `GcFreeze` moves every object
alive into the collector's permanent generation (`gc.freeze`), which collections skip, so later
ones walk only what was made since. Frozen objects are still freed when their last reference goes;
only reference cycles among them wait until `release` (the trainer's close) hands them back.
"""

from __future__ import annotations

import gc


class GcFreeze:
    """Freezes the process's objects once, after the first step; `release` unfreezes them."""

    def __init__(self):
        self.is_frozen = False

    def after_step(self) -> None:
        if self.is_frozen:
            return
        gc.collect()  # what is garbage already is freed, not frozen
        gc.freeze()
        self.is_frozen = True

    def release(self) -> None:
        if self.is_frozen:
            gc.unfreeze()
            self.is_frozen = False
