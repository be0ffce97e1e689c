"""Qwen-Image's fast path: its blocks as the engine compiles them, and the adapter setting that
feeds them.

`install(adapter, options)` (called by flowrl.accel.compile_adapter for the "qwen_image" family)
switches the transformer's blocks to real-arithmetic RoPE and sequence-major activations
(`block.prepare_for_compile`) and sets the adapter's `pads_single_row`: a batch of one runs as two
identical rows at the model input (compiled blocks run a batch of 1 as 2 rows anyway; doing it
before the input projections lay the rows out sequence-major lets batch 1 reuse the blocks'
batch >= 2 graph). Nothing here changes parameters or state_dict keys.
"""

from __future__ import annotations

from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image.block import prepare_for_compile

# Inductor stores a pointwise result in its own buffer once its expression passes
# `realize_opcount_threshold` operations (default 30). With the emulated bf16 casts of compiled
# graphs (flowrl.accel.regional_compile), expressions pass it: the first LayerNorm + modulation
# kernel of a block, for one, would store its result in float32 and round it in further kernels.
# No-grad graphs only: the training graphs keep inductor's default.
NO_GRAD_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 200}


def install(adapter, options: AccelOptions = AccelOptions()) -> None:
    """Prepare a QwenImageAdapter's transformer for compilation (module docstring); again on the
    same adapter, the new `options` replace the old ones."""
    prepare_for_compile(adapter.transformer, options)
    adapter.pads_single_row = True
