"""flowrl.bench.gc_pauses: Python's garbage collections are counted and timed while the context is
open (and only then), and show in a profile as ranges of their own."""

from __future__ import annotations

import gc

import torch

from flowrl.bench.gc_pauses import GcPauses


def _garbage_cycles(count: int = 2000) -> None:
    for _ in range(count):
        node: dict = {}
        node["self"] = node  # a reference cycle only the collector frees


def test_collections_inside_the_context_are_counted_per_generation():
    gc.collect()
    with GcPauses() as pauses:
        _garbage_cycles()
        gc.collect(2)
        gc.collect(0)
    counted = pauses.as_dict()
    assert counted["full_collections"] >= 1 and pauses.collections[0] >= 1
    assert counted["seconds"] > 0 and counted["seconds"] == sum(g["seconds"] for g in counted["by_generation"])
    gc.collect(2)  # after the context: not counted
    assert pauses.as_dict()["full_collections"] == counted["full_collections"]
    assert pauses._on_collection not in gc.callbacks


def test_collections_show_in_a_profile_as_ranges():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with GcPauses(mark_in_profile=True):
            _garbage_cycles()
            gc.collect(2)
    names = {e.name for e in prof.events()}
    assert "python gc (generation 2)" in names
