"""Qwen-Image's fast path: its blocks as the engine compiles them, and the adapter hook that feeds
them.

`install(adapter, options)` (called by flowrl.accel.compile_adapter for the "qwen_image" family)
switches the transformer's blocks to real-arithmetic RoPE and sequence-major activations with the
rollout kernels (`block.prepare_for_compile`), and installs `TransformerCallHook` as the adapter's
`transformer_call_hook`: it pads a batch of one to two rows and passes each row's modulation-table
row (`modulation.ModulationTable`) and, in a rollout batch with padded text, each row's text
length (`prefix_attention`). Nothing here changes parameters or state_dict keys.
"""

from __future__ import annotations

import torch

from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image.block import prepare_for_compile
from flowrl.accel.qwen_image.modulation import ROWS_KEY, ModulationTable, applicable
from flowrl.accel.qwen_image.prefix_attention import TEXT_LENGTHS_KEY, few_runs
from flowrl.models.base import rows_to_device

# Inductor stores a pointwise result in its own buffer once its expression passes
# `realize_opcount_threshold` operations (default 30). With compile_rounding "eager", the emulated
# bf16 casts push expressions past it: the first LayerNorm + modulation kernel of a block, for one,
# would store its result in float32 and round it in further kernels. No-grad graphs only: the
# training graphs keep inductor's default, the configuration whose rollout-vs-trainer log-prob gap
# `flowrl bench logprob` measures.
NO_GRAD_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 200}


class TransformerCallHook:
    """A compiled Qwen-Image adapter's `transformer_call_hook` (see QwenImageAdapter.velocity):
    `hook(num_rows, row_sigmas, text_lengths)` -> (pad a batch of one to two rows?, extra
    attention kwargs).

    Padding: compiled blocks run a batch of 1 as 2 identical rows (see compile_in_place). Doing it
    at the model input, before the input projections lay the rows out sequence-major, lets batch 1
    reuse the blocks' batch >= 2 graph instead of compiling one for a batch-major layout.

    Modulation rows: with the rows' sigmas as host floats (the engine passes them), forwards
    without grad read each block's modulation from the per-timestep table; `table` holds it (None
    until first used, and where it cannot reproduce the blocks).

    Text lengths: forwards without grad (the rollout's, and the trainer's value passes that
    reproduce it) get each row's text length (host ints; None when no row's text is padded) as a
    CPU tensor under TEXT_LENGTHS_KEY, with `prefix_attention` on and at most
    prefix_attention.MAX_RUNS runs of equal lengths; the blocks then attend per run. Training
    forwards keep the masked call: at the trainer's micro-batch the per-run calls' host time and
    copies cost more than the unmasked kernels save (flowrl.accel.qwen_image.prefix_attention)."""

    def __init__(self, adapter, options: AccelOptions):
        self.adapter = adapter
        self.options = options
        self.table: ModulationTable | None = None

    def __call__(
        self, num_rows: int, row_sigmas: list[float] | None, text_lengths: list[int] | None = None
    ) -> tuple[bool, dict | None]:
        padded = num_rows == 1
        kwargs = {}
        rows = None if row_sigmas is None else self._table_rows(row_sigmas * (1 + padded))
        if rows is not None:
            kwargs[ROWS_KEY] = rows
        if self._attend_per_run(text_lengths):
            lengths = torch.tensor(text_lengths * (1 + padded), dtype=torch.int64)
            torch._dynamo.maybe_mark_dynamic(lengths, 0)  # one graph for every batch size
            kwargs[TEXT_LENGTHS_KEY] = lengths
        return padded, kwargs or None

    def _attend_per_run(self, text_lengths: list[int] | None) -> bool:
        """Whether the blocks get this forward's text lengths (the class docstring)."""
        return (
            text_lengths is not None
            and self.options.prefix_attention
            and not torch.is_grad_enabled()
            and few_runs(text_lengths)
        )

    def _table_rows(self, row_sigmas: list[float]) -> torch.Tensor | None:
        """Device indices of each row's timestep in the modulation table, or None where the table
        does not apply: with grad (the trainer), with `modulation_table` off, or on blocks the
        table cannot serve."""
        if torch.is_grad_enabled() or not self.options.modulation_table:
            return None
        adapter = self.adapter
        if self.table is None:
            if not applicable(adapter.transformer):
                return None
            self.table = ModulationTable(adapter.transformer)
        # The schedules are read only when the table is built, not at every step.
        rows = rows_to_device(
            self.table.rows(row_sigmas, adapter.device.type, adapter.schedule_sigma_values), adapter.device
        )
        torch._dynamo.maybe_mark_dynamic(rows, 0)  # one compiled graph for every batch size, as the activations
        return rows


def install(adapter, options: AccelOptions = AccelOptions()) -> None:
    """Prepare a QwenImageAdapter's transformer for compilation and install its call hook (module
    docstring); again on the same adapter, the new `options` replace the old ones."""
    prepare_for_compile(adapter.transformer, options)
    if adapter.transformer_call_hook is None:
        adapter.transformer_call_hook = TransformerCallHook(adapter, options)
    else:
        adapter.transformer_call_hook.options = options
