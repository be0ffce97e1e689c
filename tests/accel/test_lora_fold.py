"""flowrl.accel.lora_fold: in compiled graphs without grad (the rollout's) a LoRA projection is
one op that accumulates the low-rank term inside the base GEMM's output; it computes the same
function, applies only to adapters it computes (and not with `lora_fold=False`), casts as autocast
would, and training graphs keep the differentiable expression."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.accel import lora_fold
from flowrl.accel.options import AccelOptions


class _Projections(torch.nn.Module):
    def __init__(self, width=24, out=16, bias=True):
        super().__init__()
        self.proj = torch.nn.Linear(width, out, bias=bias)
        self.other = torch.nn.Linear(width, out, bias=bias)


def _adapted(dtype=torch.float32, bias=True, dropout=0.0, targets=("proj", "other"), options=AccelOptions()):
    """Linear layers with the trainer's LoRA forward (flowrl.models.lora), B made nonzero, on the
    folding forward as compile_adapter installs it."""
    from flowrl.models.lora import inject_lora

    torch.manual_seed(0)
    module = _Projections(bias=bias).to(dtype)
    params = inject_lora(module, 4, targets, dropout=dropout)
    assert len(params) == 2 * len(targets) and all(p.dtype == torch.float32 for p in params)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    assert lora_fold.fold_lora_projections(module, options) == len(targets)
    return module


def _expression(layer, x):
    """The eager expression: base(x) + (x A^T)(s B)^T in x's dtype."""
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    return layer.base_layer(x) + (x @ a.to(x.dtype).t()) @ (b * s).to(x.dtype).t()


def _recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _calls_op(graph, name: str) -> bool:
    return any(node.op == "call_function" and name in str(node.target) for node in graph.graph.nodes)


@pytest.mark.parametrize("bias, fold", [(True, True), (False, True), (True, False)])
def test_rollout_graph_runs_the_folded_op_with_the_expressions_values(bias, fold):
    """With `lora_fold=False` the rollout graph keeps the expression instead."""
    layer = _adapted(bias=bias, options=AccelOptions(lora_fold=fold)).proj
    x = torch.randn(3, 5, 24)
    graphs = []
    compiled = torch.compile(layer, backend=_recording_backend(graphs), dynamic=False)
    with torch.no_grad():
        got = compiled(x)
        want = _expression(layer, x)
    assert len(graphs) == 1 and _calls_op(graphs[0], "lora_linear") is fold
    assert got.shape == (3, 5, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # float32: only the summation order differs
    assert not torch.equal(layer.base_layer(x), want)  # the low-rank term is there to be lost


def test_training_graph_keeps_the_differentiable_expression():
    module = _adapted()
    layer = module.proj
    x = torch.randn(2, 7, 24)
    graphs = []
    compiled = torch.compile(layer, backend=_recording_backend(graphs), dynamic=False)
    compiled(x).square().sum().backward()
    assert len(graphs) == 1 and not _calls_op(graphs[0], "lora_linear")
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    assert set(grads) == {"lora_A.default.weight", "lora_B.default.weight"}
    for p in layer.parameters():
        p.grad = None
    _expression(layer, x).square().sum().backward()
    for name, param in layer.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5)


def test_bf16_op_rounds_where_its_gemm_order_says():
    """In bf16 the op's first GEMM (the low-rank term plus bias) writes a rounded output and the base
    GEMM accumulates its float32 product into it before rounding once more: within half a bf16 step
    of (first output, rounded) + (second product, unrounded). The expression (each term rounded on
    its own, then their sum) is not that close."""
    layer = _adapted(torch.bfloat16).proj
    x = torch.randn(256, 24, dtype=torch.bfloat16)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    down, up, base = a.to(torch.bfloat16), (b * s).to(torch.bfloat16), layer.base_layer
    with torch.no_grad():
        got = lora_fold.lora_linear(x, base.weight, base.bias, down, up)
        low_rank_input = x @ down.t()  # bf16, as the op keeps it
        want = torch.addmm(base.bias, low_rank_input, up.t()).float() + x.float() @ base.weight.float().t()
        expression = _expression(layer, x)
    assert got.dtype == torch.bfloat16
    half_step = want.abs() * 2**-8  # half a step of bf16 (8 significant bits) at |want|
    assert ((got.float() - want).abs() <= half_step).all()
    assert not ((expression.float() - want).abs() <= half_step).all()


def test_the_op_computes_the_expressions_function():
    layer = _adapted().proj
    x = torch.randn(40, 24)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    with torch.no_grad():
        output = lora_fold.lora_linear(x, layer.base_layer.weight, layer.base_layer.bias, a, b * s)
        torch.testing.assert_close(output, _expression(layer, x), atol=1e-6, rtol=1e-6)


def test_under_autocast_the_op_casts_its_inputs_as_autocast_does():
    layer = _adapted().proj  # float32 weights, as a model under the trainer's mixed precision may have
    x = torch.randn(4, 24)
    graphs = []
    compiled = torch.compile(layer, backend=_recording_backend(graphs), dynamic=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x)
        want = layer(x)  # eager: the expression under autocast
    assert _calls_op(graphs[0], "lora_linear")
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fold_applies_only_to_adapters_it_computes():
    from peft import LoraConfig

    module = _adapted()
    assert lora_fold.folds(module.proj) and not lora_fold.folds(torch.nn.Linear(2, 2))
    assert not lora_fold.folds(_adapted(dropout=0.1).proj)  # dropout: the op has none
    assert not lora_fold.folds(_adapted(options=AccelOptions(lora_fold=False)).proj)  # the switch
    layer = copy.deepcopy(module.proj)
    layer.enable_adapters(False)  # the KL reference
    assert not lora_fold.folds(layer)
    layer = copy.deepcopy(module.proj)
    layer.update_layer("second", r=2, lora_alpha=2, config=LoraConfig(r=2, lora_alpha=2))
    layer.set_adapter(["default", "second"])  # two active adapters
    assert not lora_fold.folds(layer)
    from peft import inject_adapter_in_model  # peft's own forward (not flowrl's): left alone

    plain = inject_adapter_in_model(LoraConfig(r=2, target_modules=["proj"]), _Projections())
    assert lora_fold.fold_lora_projections(plain) == 0 and not lora_fold.folds(plain.proj)


def _adapted_mlp(options=AccelOptions()):
    """A diffusers tanh-GELU FeedForward with the trainer's LoRA on both projections (B nonzero), on
    the folding and GELU-epilogue forwards as compile_adapter installs them."""
    from diffusers.models.attention import FeedForward

    from flowrl.accel.fused_mlp import fuse_gelu_epilogues
    from flowrl.models.lora import inject_lora

    torch.manual_seed(0)
    mlp = FeedForward(24, dim_out=24, mult=2, activation_fn="gelu-approximate")
    inject_lora(mlp, 4, ["net.0.proj", "net.2"])
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    assert lora_fold.fold_lora_projections(mlp, options) == 2
    assert fuse_gelu_epilogues(mlp, options) == 1
    return mlp


@pytest.mark.parametrize("gelu_epilogue", [True, False])
def test_rollout_graph_of_an_adapted_mlp_takes_its_gelu_into_the_folded_op(gelu_epilogue):
    """The MLP's first projection runs `lora_linear_gelu_tanh` (one GEMM over [x | x A^T] and
    [W | s B], the GELU in its epilogue) with the eager module's values; with `gelu_epilogue=False`
    it stays the folded projection and a GELU of its own."""
    mlp = _adapted_mlp(AccelOptions(gelu_epilogue=gelu_epilogue))
    x = torch.randn(3, 5, 24)
    graphs = []
    compiled = torch.compile(mlp, backend=_recording_backend(graphs), dynamic=False)
    with torch.no_grad():
        got = compiled(x)
        want = mlp(x)  # eager: the trainer's LoRA expression, then GELU
    assert len(graphs) == 1 and _calls_op(graphs[0], "lora_linear_gelu_tanh") is gelu_epilogue
    assert _calls_op(graphs[0], "lora_linear.")  # the second projection folds either way
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # float32: only the summation order differs
    up = mlp.net[0].proj
    without_low_rank = mlp.net[2](torch.nn.functional.gelu(up.base_layer(x), approximate="tanh"))
    assert not torch.allclose(without_low_rank, want, atol=1e-3)  # the first low-rank term is there to be lost


def _merged_value(layer):
    """W + s B A of `layer` in float32 (what a float32 merge holds, up to summation order)."""
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    return layer.base_layer.weight + s * b @ a


def test_rollout_graphs_on_merged_weights_run_plain_gemms_and_a_new_merge_compiles_nothing():
    """During a merged training rollout (flowrl.accel.lora_merge) the projection and the adapted
    MLP's GELU epilogue take the merged weight without the low-rank GEMMs;
    the merged weights are graph inputs, so the next merge (new weights) reuses the graph, and
    after the rollout the folded op is back."""
    from flowrl.accel.lora_merge import merged_lora

    module, mlp = _adapted(), _adapted_mlp()
    x = torch.randn(3, 5, 24)
    graphs, mlp_graphs = [], []
    compiled = torch.compile(module.proj, backend=_recording_backend(graphs), dynamic=False)
    compiled_mlp = torch.compile(mlp, backend=_recording_backend(mlp_graphs), dynamic=False)
    with torch.no_grad():
        compiled(x)
        compiled_mlp(x)
        for seed in (0, 1):
            with merged_lora(module, seed), merged_lora(mlp, seed):
                torch.testing.assert_close(
                    compiled(x), x @ _merged_value(module.proj).t() + module.proj.base_layer.bias
                )
                torch.testing.assert_close(compiled_mlp(x), mlp(x))  # eager on the merged weights too
                assert lora_fold.folds(module.proj)
            for layer in (module.proj, mlp.net[0].proj):
                merged = _merged_value(layer)
                with torch.no_grad():
                    layer.lora_B["default"].weight.add_(0.1)  # the next step's adapter
                assert not torch.equal(merged, _merged_value(layer))
        got = compiled(x)
    torch.testing.assert_close(got, _expression(module.proj, x), atol=1e-6, rtol=1e-6)
    assert len(graphs) == len(mlp_graphs) == 2  # the folded graph and the merged one, each once
    assert _calls_op(graphs[0], "lora_linear") and not _calls_op(graphs[1], "lora_linear")
    assert _calls_op(mlp_graphs[1], "lora_linear_gelu_tanh") and not _calls_op(mlp_graphs[1], "lora_linear.")


def test_training_graph_of_an_adapted_mlp_keeps_the_differentiable_expression():
    mlp = _adapted_mlp()
    graphs = []
    compiled = torch.compile(mlp, backend=_recording_backend(graphs), dynamic=False)
    compiled(torch.randn(2, 3, 24)).square().sum().backward()
    assert len(graphs) == 1 and not _calls_op(graphs[0], "lora_linear")
    assert all(p.grad is not None for name, p in mlp.named_parameters() if "lora_" in name)


@pytest.mark.gpu
@pytest.mark.parametrize("width, rank", [(64, 16), (24, 4)], ids=["aligned", "unaligned"])
def test_lora_gelu_op_on_cuda_is_the_activation_within_bf16_rounding(width, rank):
    """On CUDA the op's GEMM takes the bias and GELU into cuBLASLt's epilogue (the joint contraction
    width + rank, 16-byte aligned or not): its values are the float32 expression's within bf16
    rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cpu").manual_seed(0)
    bf16 = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)  # noqa: E731
    x, weight, bias = bf16(3, 100, width), bf16(4 * width, width, scale=width**-0.5), bf16(4 * width, scale=0.1)
    down, up = bf16(rank, width, scale=width**-0.5), bf16(4 * width, rank, scale=0.3)
    with torch.no_grad():
        got = lora_fold.lora_linear_gelu_tanh(x, weight, bias, down, up)
        low_rank_input = (x @ down.t()).float()  # bf16, as the op keeps it
        pre = x.float() @ weight.float().t() + bias.float() + low_rank_input @ up.float().t()
        want = torch.nn.functional.gelu(pre, approximate="tanh")
    assert got.shape == (3, 100, 4 * width) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
