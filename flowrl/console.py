"""What flowrl shows on the terminal besides its results: one progress-bar style, one-line notes,
and third-party notices silenced where they start.

- `progress_bar(...)`: the tqdm bar of every flowrl phase (model loading, training steps with the
  step's current phase). Bars go to stderr; stdout keeps the results. No tqdm monitor thread is
  started (a thread alive at exit is what turns a Ctrl-C into a crash).
- `note(text)`: a one-line message printed above any open bar (stderr).
- `quiet_third_party()`: the `flowrl` command calls it before a command runs; library users keep
  the libraries' defaults. It turns off the nested progress bars of transformers and
  huggingface_hub (their documented switch, HF_HUB_DISABLE_PROGRESS_BARS, read when they are
  imported; flowrl shows its own loading bar instead) and drops, by message, transformers' notice
  "`...ImageProcessor` requires torchvision (not installed); falling back to ...": flowrl uses no
  image processor, and PyPI's torchvision does not import beside the pinned torch.
  `quiet_local_ray_worker()` does the same in the Ray processes of a local Ray launch, and drops
  Ray Train's repeated notice that the State API (which that Ray leaves off) is unreachable.
- `library_bars_off()`: a context in which diffusers' and transformers' own bars are off, for
  flowrl code that shows its own bar around their loading functions.
- `allow_tracing_cached_checks()`: Dynamo warns when it traces a `functools.lru_cache` function.
  diffusers' `is_*_available` / `is_*_version` checks, called inside forwards (the bf16 branch of
  its VAE upsampler, for one), are cached constants, so tracing through them is exact; this marks
  exactly those so Dynamo stays quiet about them and keeps warning about any other cached function.

Importing this module imports neither torch, diffusers nor transformers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

# transformers.utils.import_utils logs this once per image processor class the pipelines import.
_TORCHVISION_NOTICE = "requires torchvision (not installed); falling back to"
# Ray Train's placement-group cleaner asks Ray's State API every second, which the dashboard serves:
# on a local Ray started without it (flowrl's) each ask fails and logs this, all run long.
_RAY_STATE_API_NOTICE = "Failed to query Ray Train Controller actor state"
_RAY_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_third_party() -> None:
    """Silence the known-harmless third-party output of a flowrl command (see the module docstring)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # already imported (in-process callers): the switch was read
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    source = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _DropMessages) for f in source.filters):
        source.addFilter(_DropMessages(_TORCHVISION_NOTICE))


def quiet_local_ray_worker() -> None:
    """Ray's `worker_process_setup_hook` of a local Ray flowrl starts (flowrl.distributed.ray_launcher):
    `quiet_third_party` in every Ray process of the run (its workers import transformers too), and
    the placement-group cleaner's notice that the State API, which that Ray leaves off, cannot be
    reached."""
    quiet_third_party()
    cleaner = logging.getLogger(_RAY_CLEANER_LOGGER)
    if not any(isinstance(f, _DropMessages) for f in cleaner.filters):
        cleaner.addFilter(_DropMessages(_RAY_STATE_API_NOTICE))


@contextlib.contextmanager
def library_bars_off():
    """diffusers' and transformers' progress bars off inside, restored afterwards."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    was_on = diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on[0]:
            diffusers_logging.enable_progress_bar()
        if was_on[1]:
            transformers_logging.enable_progress_bar()


@functools.cache
def allow_tracing_cached_checks() -> None:
    """Let Dynamo trace diffusers' cached availability/version checks without a warning; a torch
    release without that switch (2.11 has none) is left as it is."""
    import diffusers.utils.import_utils as checks
    import torch._dynamo.utils as dynamo_utils

    allow_lru_cache_wrapper_trace_without_warning = getattr(
        dynamo_utils, "allow_lru_cache_wrapper_trace_without_warning", None
    )
    if allow_lru_cache_wrapper_trace_without_warning is None:
        return
    for name, value in vars(checks).items():
        if name.startswith("is_") and isinstance(value, functools._lru_cache_wrapper):
            allow_lru_cache_wrapper_trace_without_warning(value)


def progress_bar(total: int | None = None, desc: str = "", initial: int = 0, disable: bool = False, unit: str = "it"):
    """A flowrl progress bar (tqdm, stderr); use as a context manager or close() it."""
    from tqdm.auto import tqdm
    from tqdm.std import tqdm as std_tqdm

    std_tqdm.monitor_interval = 0  # no monitor thread
    is_terminal = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        initial=initial,
        disable=disable,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.1 if is_terminal else 2.0,  # a log file gets a line every few seconds, not a flood
    )


def note(text: str) -> None:
    """Print one line to stderr without breaking an open progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stderr)
