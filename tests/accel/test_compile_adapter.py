"""flowrl.accel's one entry: bad settings are errors that name the choices, settings fixed by the
first call stay fixed, the family's regions are compiled and reported, and importing the core
(or flowrl.accel itself) loads none of torch's compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flowrl.accel import compile_adapter, is_compiled
from flowrl.bench.models import build_bench_model


@pytest.fixture
def sd3():
    return build_bench_model("tiny-sd3", "cpu", torch.float32).adapter


def test_bad_settings_name_the_choices(sd3):
    with pytest.raises(
        ValueError, match=r"backend='turbo' is unknown; use one of \('inductor', 'aot_eager', 'eager'\)"
    ):
        compile_adapter(sd3, "turbo")
    with pytest.raises(ValueError, match="unknown switch norm_kernel=False; the switches are gelu_epilogue, "):
        compile_adapter(sd3, "eager", norm_kernel=False)
    with pytest.raises(ValueError, match="switch lora_fold=0 must be True or False"):
        compile_adapter(sd3, "eager", lora_fold=0)
    assert not is_compiled(sd3)  # nothing was changed by a refused call


def test_regions_and_idempotence(sd3):
    names = compile_adapter(sd3, "eager")
    blocks = len(sd3.transformer.transformer_blocks)
    assert names == [f"transformer.transformer_blocks.{i}" for i in range(blocks)] + ["vae.decoder"]
    assert is_compiled(sd3) and compile_adapter(sd3, "eager", gelu_epilogue=False) == names
    with pytest.raises(ValueError, match="compiled already"):
        compile_adapter(sd3, "aot_eager")


def test_blocks_tune_their_kernels_and_the_decoder_does_not(sd3, monkeypatch):
    """inductor's coordinate-descent tuning times every generated kernel at compile time: the
    blocks (run every denoising step) get it, the VAE decoder (once per sample) does not."""
    options_of = {}

    def record(fn, backend=None, dynamic=None, options=None):
        owner = getattr(fn, "__self__", None)
        options_of.setdefault(id(owner), []).append(dict(options or {}))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    compile_adapter(sd3, "inductor")
    decoder = options_of[id(sd3.vae.decoder)]
    block = options_of[id(sd3.transformer.transformer_blocks[0])]
    assert decoder and all(not o["coordinate_descent_tuning"] for o in decoder)
    assert block and all(o["coordinate_descent_tuning"] for o in block)


def test_flux_compiles_its_double_and_single_stream_blocks_and_its_decoder():
    adapter = build_bench_model("tiny-flux", "cpu", torch.float32).adapter
    transformer = adapter.transformer
    expected = [f"transformer.transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
    expected += [
        f"transformer.single_transformer_blocks.{i}" for i in range(len(transformer.single_transformer_blocks))
    ]
    assert compile_adapter(adapter, "eager") == expected + ["vae.decoder"] and len(expected) == 4


def test_qwen_layout_is_fixed_by_the_first_call():
    adapter = build_bench_model("tiny-qwen", "cpu", torch.float32).adapter
    compile_adapter(adapter, "eager", sequence_major=False)
    assert adapter.pads_single_row
    with pytest.raises(ValueError, match="sequence_major=True but this transformer's blocks run sequence_major=False"):
        compile_adapter(adapter, "eager")


def test_importing_the_core_loads_no_compiler():
    code = (
        "import sys, flowrl.accel, flowrl.engine.engine, flowrl.trainer.trainer, flowrl.trainer.logprob, "
        "flowrl.rollout.agent_loop, flowrl.config, flowrl.models\n"
        "loaded = [m for m in sys.modules if m.startswith(('torch._inductor', 'flowrl.accel.'))]\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
