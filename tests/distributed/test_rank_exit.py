"""A torchrun rank ends through `end_rank_process`: with its exit code, its output flushed and its
atexit handlers run, and without the interpreter's teardown, where the gloo process group that
outlives destroy_process_group could abort a finished rank (a CI run failed so:
benchmarks/results/2026-12-06_rank-exit_cpu.md). The `sys.exit` twin shows the teardown this skips."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from flowrl.distributed.launch import end_rank_process

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    kept = Teardown()  # a module global: deleted only in the interpreter's teardown
    atexit.register(print, "atexit ran")
    sys.stdout.write("unflushed output;")
    sys.stderr.write("unflushed error;")
    {end}(3)
    """
)


@pytest.mark.parametrize("end", ["end_rank_process", "sys.exit"])
def test_a_rank_ends_with_its_code_and_output_but_without_the_teardown(end):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(end=end)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("unflushed output;") and "atexit ran" in done.stdout, done.stdout
    assert "unflushed error;" in done.stderr
    assert ("teardown ran" in done.stdout) == (end == "sys.exit"), done.stdout
