"""trainer.cuda_graphs: the compiled blocks' training graphs replayed as CUDA graphs.

On the CPU: the setting is resolved and checked where the issue is cheapest to name (config,
before the model loads, at the trainer), grad calls of a compiled block are routed to the graphed
compile and no-grad calls never are, a grad-mode scoring marks a new step for the graph trees,
and the update with gradients allocated ahead (what the graphs need) is the same update to the
bit. On a GPU (marked gpu): a compiled tiny Qwen-Image's update accumulates the same gradients
with and without them, and inductor graphs every training graph it was asked to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.trainer.build import uses_training_cuda_graphs


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_grad_calls_take_the_graphed_compile_and_no_grad_calls_never_do():
    """On the CPU inductor runs a graph it was asked to graph without CUDA graphs and counts the
    skip: the count moves exactly when a call took the graphed compile."""
    from torch._dynamo.utils import counters

    from flowrl.accel.regional_compile import compile_in_place, set_grad_cuda_graphs

    torch.manual_seed(0)
    block = _Block()
    compile_in_place(block, "inductor")
    x = torch.randn(4, 8)

    def grads():
        block.zero_grad(set_to_none=True)
        block(x).square().sum().backward()
        return [p.grad.clone() for p in block.parameters()]

    skips = lambda: counters["inductor"]["cudagraph_skips"]  # noqa: E731
    start = skips()
    plain = grads()
    assert skips() == start
    set_grad_cuda_graphs(block, True)
    with torch.no_grad():
        block(x)
    assert skips() == start  # a no-grad call (the rollout's) is never graphed
    graphed = grads()
    assert skips() > start  # the grad call went to the graphed compile (skipped here: no GPU)
    for a, b in zip(plain, graphed):
        torch.testing.assert_close(a, b)


def test_graph_switch_needs_a_compiled_module_and_inductor():
    from flowrl.accel.regional_compile import compile_in_place, set_grad_cuda_graphs

    with pytest.raises(ValueError, match="not compiled"):
        set_grad_cuda_graphs(_Block(), True)
    block = _Block()
    compile_in_place(block, "eager")
    with pytest.raises(ValueError, match="inductor"):
        set_grad_cuda_graphs(block, True)
    set_grad_cuda_graphs(block, False)  # off is always possible


def test_training_cuda_graphs_need_a_cuda_device():
    from flowrl.accel import compile_adapter, set_training_cuda_graphs
    from flowrl.bench.models import build_bench_model

    adapter = build_bench_model("tiny-sd3", "cpu", torch.float32).adapter
    with pytest.raises(ValueError, match="compiled model"):
        set_training_cuda_graphs(adapter, True)
    compile_adapter(adapter, "eager")
    with pytest.raises(ValueError, match="CUDA device; the model is on cpu"):
        set_training_cuda_graphs(adapter, True)


def test_true_with_sharded_weights_names_the_setting():
    assert uses_training_cuda_graphs(SimpleNamespace(cuda_graphs=True), sharded=False)
    assert not uses_training_cuda_graphs(SimpleNamespace(cuda_graphs=False), sharded=True)
    with pytest.raises(ValueError, match="trainer.cuda_graphs=true with sharded weights"):
        uses_training_cuda_graphs(SimpleNamespace(cuda_graphs=True), sharded=True)


def test_true_without_compile_or_a_gpu_is_refused_before_the_model_loads(tiny_run_config, tmp_path):
    from flowrl.trainer.build import check_before_loading

    with pytest.raises(ValueError, match=r"trainer\.cuda_graphs.*engine\.compile=true"):
        tiny_run_config(tmp_path / "a", "trainer.cuda_graphs=true")
    cfg = tiny_run_config(tmp_path / "b", "trainer.cuda_graphs=true", "engine.compile=true", "model.device=cpu")
    with pytest.raises(ValueError, match=r"trainer\.cuda_graphs=true needs a CUDA device.*'cpu'"):
        check_before_loading(cfg)


def test_off_by_default(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg("engine.compile=true"))
    assert trainer.cfg.trainer.cuda_graphs is False and not trainer.updater.cuda_graphs


def test_a_grad_scoring_starts_a_graph_step_and_a_no_grad_one_does_not(build_trainer, make_cfg, take_rollout):
    from torch._inductor import cudagraph_trees

    from flowrl.trainer.policy import score_transitions

    trainer = build_trainer(make_cfg())
    tensors, specs = take_rollout(trainer)
    step_index = torch.zeros(len(specs), dtype=torch.long)
    counter = lambda: cudagraph_trees.MarkStepBox.mark_step_counter  # noqa: E731
    before = counter()
    with torch.no_grad():
        score_transitions(trainer.adapter, tensors, step_index, specs)
    assert counter() == before
    with torch.enable_grad():
        score_transitions(trainer.adapter, tensors, step_index, specs).log_prob.sum().backward()
    assert counter() == before - 1


def test_gradients_allocated_ahead_give_the_same_update(build_trainer, make_cfg, take_rollout):
    """With CUDA graphs the updater adds every backward into `.grad` tensors it allocated (zeros)
    before the optimizer step's first backward, where otherwise the first backward's gradient
    becomes `.grad`: 0 + g is g, so the weights come out equal to the bit."""
    results = {}
    for graphs in (False, True):
        trainer = build_trainer(
            make_cfg(
                "trainer.lora.enabled=true",
                "rollout.n=2",
                "trainer.prompts_per_step=4",
                "trainer.updates_per_step=2",
                "trainer.micro_batch_size=2",  # two micro-batches per optimizer step: accumulation
                "algorithm.old_log_prob=recompute",
                output=f"graphs-{graphs}",
            )
        )
        trainer.updater.cuda_graphs = graphs  # what the trainer sets on a GPU; the CPU has no graphs
        allocated = []
        original = trainer.updater._allocate_gradients
        trainer.updater._allocate_gradients = lambda: allocated.append(1) or original()
        tensors, specs = take_rollout(trainer)
        metrics = trainer.updater.update(tensors, specs, torch.linspace(-1.0, 1.0, 8), torch.ones(8), step=1)
        assert len(allocated) == (2 if graphs else 0)  # once per optimizer step
        assert ("compile/cuda_graph_skips" in metrics) == graphs
        results[graphs] = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters()}
    assert results[True].keys() == results[False].keys()
    for name, value in results[False].items():
        assert torch.equal(value, results[True][name]), name


@pytest.mark.gpu
def test_the_update_with_cuda_graphs_accumulates_the_gradients_it_does_without_on_cuda(
    build_trainer, make_cfg, take_rollout
):
    """A compiled tiny Qwen-Image on CUDA (bf16 autocast, true CFG, LoRA, the recompute with grad,
    two optimizer steps of two micro-batches each) runs the same update of the same rollout from
    the same weights without CUDA graphs, then twice with them (graphs warm up, record, then
    replay): inductor graphs every training graph it was asked to, and each optimizer step's
    accumulated gradient is the one without graphs up to bf16 rounding (the two compiles may tune
    kernel launch configurations apart), far below what a lost or overwritten micro-batch would
    change (about half of it)."""
    from flowrl.accel import set_training_cuda_graphs

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    trainer = build_trainer(
        make_cfg(
            "model.path=random:tiny-qwen",
            "model.device=cuda",
            "model.dtype=bfloat16",
            "trainer.mixed_precision=bf16",
            "engine.compile=true",
            "trainer.cuda_graphs=true",
            "trainer.lora.enabled=true",
            "rollout.n=4",
            "trainer.prompts_per_step=2",
            "trainer.updates_per_step=2",
            "trainer.micro_batch_size=2",
            "trainer.gradient_checkpointing=false",
            "algorithm.old_log_prob=recompute",
            "rollout.sampling.num_inference_steps=4",
            "rollout.sampling.guidance_scale=4.0",
        )
    )
    updater = trainer.updater
    assert updater.cuda_graphs
    tensors, specs = take_rollout(trainer)
    advantages = torch.linspace(-1.0, 1.0, len(specs))
    start = [p.detach().clone() for p in updater.params]
    original_step = updater._optimizer_step

    def run_update(graphs: bool) -> tuple[list[torch.Tensor], dict]:
        set_training_cuda_graphs(trainer.adapter, graphs)
        updater.cuda_graphs = graphs
        with torch.no_grad():
            for param, value in zip(updater.params, start):
                param.copy_(value)  # in place: the graphs' recorded addresses stay valid
        updater.optimizer.state.clear()
        grads = []

        def step():
            grads.append(torch.cat([p.grad.detach().float().flatten() for p in updater.params]))
            return original_step()

        updater._optimizer_step = step
        metrics = updater.update(tensors, specs, advantages, torch.ones(len(specs)), step=1)
        return grads, metrics

    plain, _ = run_update(False)
    for attempt in range(2):
        graphed, metrics = run_update(True)
        errors = [float((g - p).norm() / p.norm()) for g, p in zip(graphed, plain)]
        print(f"with CUDA graphs, run {attempt}: relative gradient error per optimizer step {errors}")
        assert len(graphed) == len(plain) == 2 and max(errors) < 0.05, errors
        assert metrics["compile/cuda_graph_skips"] == 0


def test_bench_logprob_times_without_then_with_graphs_and_only_where_they_can_run():
    from flowrl.bench.logprob import _cuda_graph_modes

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert _cuda_graph_modes("off", False, cpu) == [False]
    assert _cuda_graph_modes("both", True, gpu) == [False, True]
    assert _cuda_graph_modes("on", True, gpu) == [True]
    for setting, compiled, device in (("both", True, cpu), ("on", False, gpu)):
        with pytest.raises(ValueError, match=f"--cuda-graphs={setting} .*--compile"):
            _cuda_graph_modes(setting, compiled, device)
