"""Console hygiene (flowrl.console): the README's training command prints flowrl's own lines only,
and the known-harmless third-party notices are silenced at their source, not hidden wholesale."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import warnings

FLOWRL_LINES = ("flowrl train", "loading model")


def test_embedded_train_prints_no_third_party_line(tmp_path):
    # A clean machine: no switches of ours or the libraries' set beforehand.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHONWARNINGS", "TRANSFORMERS_"))}
    env["FLOWRL_CACHE"] = str(tmp_path / "cache")  # the tiny model is built (written) in this run too
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowrl.cli",
            "train",
            "trainer.total_steps=1",
            "trainer.val_every=1",
            "trainer.save_every=1",
            "trainer.prompts_per_step=2",
            "rollout.n=2",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(FLOWRL_LINES)]
    assert not foreign, foreign[:10]
    assert any("validation" in line for line in lines) and any("update" in line for line in lines)
    assert "steps trained: 1" in result.stdout


def test_torchvision_notice_is_dropped_and_other_transformers_warnings_are_not(caplog):
    from flowrl.console import quiet_third_party

    quiet_third_party()
    source = logging.getLogger("transformers.utils.import_utils")
    with caplog.at_level(logging.WARNING, logger="transformers.utils.import_utils"):
        source.warning("`SiglipImageProcessor` requires torchvision (not installed); falling back to `X`")
        source.warning("something else entirely")
    assert [r.getMessage() for r in caplog.records] == ["something else entirely"]


def test_dynamo_traces_diffusers_version_checks_quietly_but_still_warns_for_others():
    import torch
    from diffusers.utils.import_utils import is_torch_version

    from flowrl.console import allow_tracing_cached_checks

    @functools.lru_cache
    def cached_scale() -> float:
        return 2.0

    def forward(x):
        return x * (2.0 if is_torch_version(">=", "2.0") else 1.0) * cached_scale()

    allow_tracing_cached_checks()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(forward, backend="eager")(torch.ones(2))
    messages = [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    # One warning: the test's own cached function; diffusers' check was traced without one.
    assert len(messages) == 1 and "test_console.py" in messages[0], messages


def test_progress_bar_starts_no_monitor_thread():
    # In a fresh process: an earlier test's third-party bar may have started tqdm's monitor here.
    script = (
        "import threading; from flowrl.console import progress_bar\n"
        "with progress_bar(total=3, desc='x') as bar: bar.update(3)\n"
        "print(sorted(t.name for t in threading.enumerate()))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "['MainThread']", result


def test_a_torch_without_the_quiet_tracing_switch_is_left_as_it_is(monkeypatch):
    """torch 2.11 has no allow_lru_cache_wrapper_trace_without_warning: compiling must not fail
    there (it did: compile_adapter raised an ImportError on such a torch)."""
    import torch._dynamo.utils as dynamo_utils

    from flowrl.console import allow_tracing_cached_checks

    monkeypatch.delattr(dynamo_utils, "allow_lru_cache_wrapper_trace_without_warning", raising=False)
    allow_tracing_cached_checks.cache_clear()
    try:
        allow_tracing_cached_checks()  # no ImportError
    finally:
        allow_tracing_cached_checks.cache_clear()
