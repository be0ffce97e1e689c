"""Scheduler invariants under random arrivals (hypothesis): bounded rows, compatible groups,
FIFO admission, no starvation."""

from __future__ import annotations

from concurrent.futures import Future

from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.engine import SamplingParams
from flowrl.engine.sample import SampleState
from flowrl.engine.scheduler import Scheduler

request = st.tuples(
    st.sampled_from([(64, 64), (64, 128)]),  # shape
    st.booleans(),  # CFG
    st.integers(1, 5),  # steps
    st.integers(0, 6),  # arrival iteration
)


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=1, max_size=12), st.integers(2, 6))
def test_scheduler_invariants(requests, max_rows):
    scheduler = Scheduler(max_rows)
    samples = []
    for (h, w), cfg, steps, arrival in requests:
        params = SamplingParams(height=h, width=w, num_inference_steps=steps, guidance_scale=2.0 if cfg else 1.0)
        samples.append((arrival, SampleState("p", params, 0, (0, 0), Future(), num_rows=2 if cfg else 1)))
    admitted_order = []
    finished = []
    for iteration in range(200):
        for arrival, s in samples:
            if arrival == iteration:
                scheduler.add(s)
        admitted_order += scheduler.admit()
        assert scheduler.running_rows <= max_rows
        group = scheduler.schedule()
        if not group:
            if iteration > 6:
                break
            continue
        assert len({s.batch_key for s in group}) == 1
        assert sum(s.num_rows for s in group) <= max_rows
        for s in group:
            s.step += 1
        done = [s for s in group if s.is_finished]
        scheduler.remove(done)
        finished += done
    assert len(finished) == len(samples)  # everybody finished: no starvation
    order = sorted(samples, key=lambda t: t[0])
    # FIFO: admission follows arrival order (ties keep submission order).
    assert [id(s) for s in admitted_order] == [id(s) for _, s in order]
