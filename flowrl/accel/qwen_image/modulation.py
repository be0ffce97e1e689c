"""Qwen-Image's per-block modulation read from a table of the rollout's timesteps.

Every Qwen-Image block turns the timestep embedding into its adaptive-norm parameters with two
GEMMs, one per stream (3072 -> 18432 each). At a rollout's few rows those are pure weight reads,
2 x 113 MB per block at every step. A rollout steps through a fixed schedule, so every row's
timestep is one of a few dozen values. `ModulationTable` computes every block's two modulations for those
values in one pass (M = the table's rows instead of M = B at every step) and a forward gathers
its rows; inside a compiled block the gather becomes an indexed load of the kernels that apply
the modulation.

- Keys are host floats: the executor knows every row's sigma on the host (the adapter's
  timestep is the sigma), so finding a row costs no read-back from the device.
- The table is rebuilt when a key is missing or a weight it depends on changed: the version
  counters of the time embedding's and the modulation layers' parameters, which every in-place
  update advances (optimizer steps, `copy_`, `load_state_dict`), plus the autocast state.
- Row capacity is a power of two >= 64: the compiled blocks see the table's shape, so a
  schedule that adds keys rarely means a new graph.
- Used only without grad (the trainer computes its modulation in the forward, so gradients
  reach those layers in full fine-tuning), and only where the table computes what the block
  would: plain SiLU + nn.Linear modulation layers (not LoRA-wrapped), a time embedding that
  depends on the timestep alone, blocks running flowrl's sequence-major forward
  (flowrl.accel.qwen_image.block).

Numerics: the table's GEMM has M = its capacity and the block's M = B; cuBLAS may round a row
differently with M, as it may between a rollout's B = 16 and a trainer micro-batch. The
rollout-vs-trainer log-prob gap is measured with the table in place (`flowrl bench logprob`).
"""

from __future__ import annotations

import torch

# The key blocks find their row indices under in `joint_attention_kwargs`.
ROWS_KEY = "flowrl_modulation_rows"
MIN_CAPACITY = 64


def _plain_modulation(layer: torch.nn.Module) -> bool:
    return (
        isinstance(layer, torch.nn.Sequential)
        and len(layer) == 2
        and type(layer[0]) is torch.nn.SiLU
        and type(layer[1]) is torch.nn.Linear
    )


def applicable(transformer: torch.nn.Module) -> bool:
    """Whether a table reproduces `transformer`'s modulation (see the module docstring)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenTimestepProjEmbeddings

    embed = getattr(transformer, "time_text_embed", None)
    blocks = getattr(transformer, "transformer_blocks", ())
    return (
        getattr(transformer, "_flowrl_sequence_major", False)
        and not getattr(transformer, "zero_cond_t", False)
        and type(embed) is QwenTimestepProjEmbeddings
        and not getattr(embed, "use_additional_t_cond", False)
        and len(blocks) > 0
        and all(_plain_modulation(b.img_mod) and _plain_modulation(b.txt_mod) for b in blocks)
    )


class ModulationTable:
    """Every block's (image, text) modulation for a set of timesteps, stored on the blocks as
    `_flowrl_modulation` (2, capacity, 6 * width) tensors; see the module docstring."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.blocks = list(transformer.transformer_blocks)
        self.params = [
            *transformer.time_text_embed.parameters(),
            *(p for b in self.blocks for p in (*b.img_mod.parameters(), *b.txt_mod.parameters())),
        ]
        self.keys: dict[float, int] = {}
        self.stamp: tuple | None = None
        self.builds = 0  # how often the table was computed (tests, logs)

    def _stamp(self, device_type: str) -> tuple:
        autocast = torch.is_autocast_enabled(device_type)
        return (
            autocast,
            torch.get_autocast_dtype(device_type) if autocast else None,
            tuple(p._version for p in self.params),
            tuple(p.data_ptr() for p in self.params),
        )

    @torch.no_grad()
    def _build(self, keys: list[float]) -> None:
        p = self.params[0]
        capacity = max(MIN_CAPACITY, 1 << (len(keys) - 1).bit_length())
        values = keys + [keys[0]] * (capacity - len(keys))  # padding rows repeat a real key
        # As the transformer does: sigma (float32) -> the model dtype, then the time embedding.
        dtype = self.blocks[0].img_mod[1].weight.dtype
        timestep = torch.tensor(values, dtype=torch.float32).to(p.device).to(dtype)
        temb = self.transformer.time_text_embed(timestep, timestep.new_empty(0))
        for block in self.blocks:
            block._flowrl_modulation = torch.stack([block.img_mod(temb), block.txt_mod(temb)])
        self.keys = {k: i for i, k in enumerate(keys)}
        self.builds += 1

    def rows(self, timesteps: list[float], device_type: str, schedule=lambda: ()) -> list[int]:
        """The table row of each timestep. The table is (re)built first when a timestep is
        missing or the weights changed; a build covers `schedule()` too (every sigma of the
        schedules in use; called only when building), so a rollout after a weight update builds
        it once, not once per step."""
        stamp = self._stamp(device_type)
        if stamp != self.stamp or any(t not in self.keys for t in timesteps):
            kept = self.keys if stamp == self.stamp else ()
            self._build(list(dict.fromkeys([*schedule(), *kept, *timesteps])))
            self.stamp = stamp
        return [self.keys[t] for t in timesteps]

    def clear(self) -> None:
        """Drop the tables from the blocks (their memory: 2 x capacity x 6 x width per block)."""
        for block in self.blocks:
            block.__dict__.pop("_flowrl_modulation", None)
        self.keys, self.stamp = {}, None
