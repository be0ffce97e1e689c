"""GPU: the colocated trainer on CUDA with a bf16 model and bf16 autocast (device placement of
every tensor of the update, mixed precision, gradient checkpointing), and the size of the
rollout-vs-trainer log-prob gap there; eager, and compiled as the GPU recipes train
(`engine.compile: true`: the rollout's no-grad graphs with their hand-written kernels, the
trainer's grad-mode graphs under gradient checkpointing, LoRA updates between rollouts)."""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _tiny_bf16_cuda_cfg(make_cfg, tmp_path_factory, kind: str, *overrides: str, output: str):
    """A config training a tiny random `kind` checkpoint on CUDA in bf16 with bf16 autocast."""
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(kind, tmp_path_factory.mktemp(f"tiny_{kind}"), seed=0)
    return make_cfg(
        f"model.path={path}",
        "model.device=cuda",
        "model.dtype=bfloat16",
        "trainer.mixed_precision=bf16",
        *overrides,
        output=output,
    )


@pytest.mark.parametrize("old_log_prob", ["rollout", "recompute"])
def test_tiny_training_on_cuda_bf16(build_trainer, make_cfg, old_log_prob):
    cfg = make_cfg(
        "model.device=cuda",
        "model.dtype=bfloat16",
        "trainer.mixed_precision=bf16",
        "trainer.gradient_checkpointing=true",
        "trainer.lora.enabled=true",
        "trainer.lr=0.01",
        "algorithm.kl_beta=0.01",
        f"algorithm.old_log_prob={old_log_prob}",
        "rollout.sampling.guidance_scale=2.0",
        "trainer.total_steps=3",
        "trainer.save_every=3",
        "trainer.val_every=3",
        output=f"gpu-{old_log_prob}",
    )
    trainer = build_trainer(cfg)
    assert trainer.adapter.device.type == "cuda"
    summary = trainer.fit()
    records = [
        json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if '"reward/mean"' in line
    ]
    assert len(records) == 3
    for record in records:
        for key in ("actor/policy_loss", "actor/grad_norm", "actor/kl", "actor/logprob_gap_max"):
            assert record[key] is not None and torch.isfinite(torch.tensor(record[key])), (key, record)
        assert record["memory/peak_reserved_gb"] >= record["memory/peak_gb"] > 0
    print(
        old_log_prob,
        "log-prob gap per step:",
        [(r["actor/logprob_gap_mean"], r["actor/logprob_gap_max"]) for r in records],
    )
    # bf16 rollout forwards vs the trainer's bf16-autocast forwards: small but nonzero on GPU.
    assert records[0]["actor/logprob_gap_max"] < 0.5
    assert records[0]["rollout/policy_lag"] == 0


def test_merged_rollouts_on_cuda_bf16_compile_once_and_stay_near_the_trainer(build_trainer, make_cfg, tmp_path_factory):
    """rollout.merge_lora on a compiled tiny Qwen-Image in bf16 with true CFG: the merged weights
    are inputs of the rollout's graphs, so after the first merged rollout the rollouts compile
    nothing new, though every step merges new weights; the rollout's log-probs stay near the
    trainer's grad graph (the merge's stochastic rounding adds to the two graphs' own gap)."""
    from torch._dynamo.utils import counters

    cfg = _tiny_bf16_cuda_cfg(
        make_cfg,
        tmp_path_factory,
        "qwen_image",
        "engine.compile=true",
        "trainer.lora.enabled=true",
        "trainer.lr=0.01",
        "algorithm.old_log_prob=recompute",
        "rollout.merge_lora=true",
        "rollout.sampling.guidance_scale=2.0",
        output="gpu-compiled-merged",
    )
    trainer = build_trainer(cfg)
    compiled_per_rollout = []
    generate = trainer.agent_loop.generate_sequences

    def counting(*args, **kwargs):
        before = counters["stats"]["unique_graphs"]
        result = generate(*args, **kwargs)
        compiled_per_rollout.append(counters["stats"]["unique_graphs"] - before)
        return result

    trainer.agent_loop.generate_sequences = counting
    records = [trainer.train_step() for _ in range(3)]
    gaps = [(r["actor/logprob_gap_mean"], r["actor/logprob_gap_max"]) for r in records]
    print("merged rollouts: graphs compiled per rollout", compiled_per_rollout, "log-prob gap per step:", gaps)
    assert compiled_per_rollout[0] > 0 and compiled_per_rollout[1:] == [0, 0]
    assert [r["rollout/policy_version"] for r in records] == [0, 1, 2]  # each rollout merged new weights
    for record in records:
        assert record["actor/logprob_gap_mean"] < 2e-3 and record["actor/logprob_gap_max"] < 2e-2, gaps


@pytest.mark.parametrize(
    "kind, old_log_prob",
    [("qwen_image", "rollout"), ("qwen_image", "recompute"), ("sd3", "rollout"), ("z_image", "rollout")],
)
def test_compiled_training_on_cuda_bf16(build_trainer, make_cfg, tmp_path_factory, kind, old_log_prob):
    """The gap is the trainer's log-prob values against the rollout's: with old_log_prob=rollout
    from its no-grad graph (flowrl.trainer.logprob's value pass), with recompute from its grad graph
    (flowrl.trainer.update.Scoring), in both cases in other batch compositions than the rollout's."""
    cfg = _tiny_bf16_cuda_cfg(
        make_cfg,
        tmp_path_factory,
        kind,
        "engine.compile=true",
        "trainer.gradient_checkpointing=true",
        "trainer.lora.enabled=true",
        "trainer.lr=0.01",
        f"algorithm.old_log_prob={old_log_prob}",
        "rollout.sampling.guidance_scale=2.0",
        "trainer.total_steps=3",
        output=f"gpu-compiled-{kind}-{old_log_prob}",
    )
    trainer = build_trainer(cfg)
    assert trainer.engine.compiled_modules
    summary = trainer.fit()
    records = [
        json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if '"reward/mean"' in line
    ]
    assert len(records) == 3
    gaps = [(r["actor/logprob_gap_mean"], r["actor/logprob_gap_max"]) for r in records]
    print(
        kind,
        old_log_prob,
        "compiled log-prob gap per step:",
        gaps,
        "first update's ratio mean / max, clipfrac:",
        records[0]["actor/ratio_mean"],
        records[0]["actor/ratio_max"],
        records[0]["actor/clipfrac"],
    )
    for record in records:
        for key in ("actor/policy_loss", "actor/grad_norm", "actor/logprob_gap_max"):
            assert record[key] is not None and torch.isfinite(torch.tensor(record[key])), (key, record)
        # Each step's gap is taken before that step's first optimizer update. Rollout mode: the
        # no-grad graph the rollout ran, so only batch composition separates them (max about
        # 1e-5). Recompute: the grad graph, which rounds bf16 intermediates at other points (mean
        # about 5e-5, max about 4e-4 here) and which the ratio never compares with the rollout;
        # its bound only says the trainer computes the rollout's function.
        mean_bound, max_bound = (1e-6, 1e-4) if old_log_prob == "rollout" else (2e-4, 2e-3)
        assert record["actor/logprob_gap_mean"] < mean_bound and record["actor/logprob_gap_max"] < max_bound, gaps
    if old_log_prob == "recompute":  # the first optimizer step's denominators are its own values
        assert records[0]["actor/ratio_max"] == 1.0 and records[0]["actor/clipfrac"] == 0.0


def test_auto_checkpointing_on_cuda_measures_the_compiled_update_and_trains_as_the_fixed_setting(
    build_trainer, make_cfg
):
    """trainer.gradient_checkpointing=auto with a compiled model on CUDA: the probe counts the
    compiled grad graph's activations (saved-tensor hooks and the allocator agree on a lower
    bound), a tiny model fits (off), and the step's update is that of the same step with
    checkpointing off.

    One step: two compiled bf16 runs on CUDA are not bit-identical (backward kernels that add with
    atomics), and from the second step on a weight one rounding step apart changes that step's
    images, whose rewards on random weights differ by a few thousandths, so the normalized
    advantages and the second update can differ entirely (2 of 5 GPU runs of two steps failed an
    exact comparison). So the first step is compared, by its gradient norm and by the elements its
    update changed: under Adam a first update is about lr x sign(gradient) per element, so rounding
    flips only the few elements whose gradient is near zero (one flip in a small weight is a large
    share of that weight's update norm: two H200 runs under torch 2.11 moved 1.3 and 1.4% of the
    elements, most of them in the modulation weights, with gradient norms within 0.6%; the bound is
    5%), while a probe that touched the gradients, the weights or a random stream would change the
    gradient norm or most elements."""
    run = (
        "model.path=random:tiny-qwen",
        "model.device=cuda",
        "model.dtype=bfloat16",
        "trainer.mixed_precision=bf16",
        "engine.compile=true",
        "rollout.sampling.num_inference_steps=4",
        "rollout.sampling.guidance_scale=4.0",
        "trainer.micro_batch_size=2",
        "trainer.total_steps=1",
    )

    def trained(trainer) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().to("cpu", torch.float32, copy=True)
            for n, p in trainer.adapter.transformer.named_parameters()
            if p.requires_grad
        }

    updates, grad_norms = {}, {}
    for setting in ("auto", "false"):
        trainer = build_trainer(make_cfg(*run, f"trainer.gradient_checkpointing={setting}", output=setting))
        initial = trained(trainer)
        summary = trainer.fit()
        updates[setting] = {name: value - initial[name] for name, value in trained(trainer).items()}
        (record,) = [
            json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if "actor/grad_norm" in line
        ]
        grad_norms[setting] = record["actor/grad_norm"]
        if setting == "auto":
            choice = trainer.algorithm.updater.checkpointing
            assert choice.measured and not choice.enabled and choice.sample_bytes > 0, choice
            print(choice.describe())
    assert any(update.norm() > 0 for update in updates["false"].values())  # the step trained
    assert grad_norms["auto"] == pytest.approx(grad_norms["false"], rel=0.01), grad_norms
    changed, total, by_name = 0, 0, []
    for name, update in updates["false"].items():
        # an element whose update moved by more than a tenth of the parameter's largest update step
        moved = int(((updates["auto"][name] - update).abs() > 0.1 * update.abs().max()).sum())
        changed, total = changed + moved, total + update.numel()
        by_name.append((moved, update.numel(), name))
    by_name.sort(reverse=True)
    print("grad norms", grad_norms, f"; update elements that moved: {changed} of {total}", by_name[:5])
    assert changed <= 0.05 * total, by_name[:5]


@pytest.mark.parametrize(
    "kind, compiled, old_log_prob, kl_beta",
    [
        ("sd3", False, "rollout", 0.0),
        ("sd3", True, "recompute", 0.04),  # the recompute with grad and the reference's forward
        ("qwen_image", True, "recompute", 0.0),  # the recompute with grad, no value pass
    ],
)
def test_the_update_waits_for_the_device_once_per_optimizer_step(
    build_trainer, make_cfg, take_rollout, tmp_path_factory, kind, compiled, old_log_prob, kl_beta
):
    """cuda sync debug mode 'warn' warns at every host sync (a read of a device value, a copy from
    pageable memory): an update's count of them is the same with 1-row micro-batches as with
    4-row ones, which run a quarter of the forwards, so none of them is inside the micro-batch
    loop (the optimizer steps and the recompute's end read the device). Each size is counted on its
    second pass: the first compiles its graphs, which reads the device too. (Qwen-Image's padded
    prompts once made diffusers copy a scalar to the device in every forward:
    flowrl/models/qwen_text_mask.py.)"""
    import warnings

    cfg = _tiny_bf16_cuda_cfg(
        make_cfg,
        tmp_path_factory,
        kind,
        f"engine.compile={str(compiled).lower()}",
        "trainer.gradient_checkpointing=false",
        "trainer.lora.enabled=true",
        "rollout.n=4",
        "trainer.prompts_per_step=2",
        "trainer.updates_per_step=2",
        f"algorithm.old_log_prob={old_log_prob}",
        f"algorithm.kl_beta={kl_beta}",
        "rollout.sampling.guidance_scale=2.0",
        output=f"gpu-syncs-{kind}-{old_log_prob}",
    )
    trainer = build_trainer(cfg)
    tensors, specs = take_rollout(trainer)
    num_rows = len(specs)
    advantages = torch.linspace(-1.0, 1.0, num_rows)
    syncs = {}
    counts = []
    for micro_batch_size in (4, 1, 4, 1):  # the first pass at each size compiles its graphs
        trainer.algorithm.updater.trainer.micro_batch_size = micro_batch_size
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, torch.ones(num_rows), step=1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[micro_batch_size] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        counts.append((micro_batch_size, len(syncs[micro_batch_size])))
    print(kind, compiled, old_log_prob, kl_beta, "syncs per pass", counts)
    assert len(syncs[1]) == len(syncs[4]), counts


@pytest.mark.parametrize("kind", ["sd3", "qwen_image"])
def test_kl_at_the_reference_weights_is_the_compiled_graphs_rounding(
    build_trainer, make_cfg, take_rollout, tmp_path_factory, kind
):
    """The LoRA starts with B = 0, so the policy is the reference. Compiled, the KL term compares
    the grad graph's step mean (flowrl.trainer.update.Scoring, old_log_prob=recompute) with the
    reference's no-grad forward with the LoRA off, another graph: its value at these weights is
    the graphs' rounding apart. Printed next to what a no-grad pass's step mean would give (the
    value pass the trainer no longer runs for it), both bounded."""
    from flowrl.models.lora import adapter_disabled
    from flowrl.sampler import kl_to_reference
    from flowrl.trainer.logprob import score_transitions

    cfg = _tiny_bf16_cuda_cfg(
        make_cfg,
        tmp_path_factory,
        kind,
        "engine.compile=true",
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
        "algorithm.kl_beta=0.04",
        "rollout.sampling.guidance_scale=4.5",
        output=f"gpu-kl-floor-{kind}",
    )
    trainer = build_trainer(cfg)
    adapter, transformer = trainer.adapter, trainer.adapter.transformer
    assert trainer.algorithm.updater.scoring.values == "grad_pass"
    assert all(float(p.abs().max()) == 0.0 for n, p in transformer.named_parameters() if "lora_B" in n)
    tensors, specs = take_rollout(trainer)
    dtype = trainer.algorithm.updater.autocast_dtype
    floors = {}
    for k in range(tensors["sigmas"].shape[1]):
        step_index = torch.full((len(specs),), k, dtype=torch.long)
        transformer.train()
        try:
            with torch.enable_grad():
                graded = score_transitions(adapter, tensors, step_index, specs, dtype)
            with torch.no_grad():
                value = score_transitions(adapter, tensors, step_index, specs, dtype)
                with adapter_disabled(transformer):
                    reference = score_transitions(adapter, tensors, step_index, specs, dtype).mean
        finally:
            transformer.eval()
        for name, result in (("grad graph", graded), ("no-grad pass", value)):
            kl = float(kl_to_reference(result, reference).detach().mean())
            floors[name] = max(floors.get(name, 0.0), kl)
    print(kind, "largest KL at the reference's weights, per step mean:", floors)
    assert all(0.0 <= kl < 1e-3 for kl in floors.values()), floors


def test_the_compiled_merge_rounding_on_cuda_equals_the_cpu_function():
    """rollout.merge_lora's compiled rounding on CUDA (Triton's int32 arithmetic, wrapping products,
    masked shifts) gives the CPU function's noise and bf16 weights, entry for entry: the merge is the
    same on any device, with keys whose sign bit is set among them."""
    from flowrl.accel.lora_merge import _compiled_round_merge_hashed, hashed_noise, round_merge_hashed, rounding_keys

    n = (1 << 22) + 3  # not a multiple of any block size
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, generator=generator) * 0.05).to(torch.bfloat16)
    delta = torch.randn(n, generator=generator) * 1e-3
    for seed, layer_number in ((0, 0), (123456789, 719)):
        keys = rounding_keys(seed, layer_number)
        assert torch.equal(hashed_noise(n, keys.cuda()).cpu(), hashed_noise(n, keys))
        on_cuda = _compiled_round_merge_hashed()(delta.cuda(), weight.cuda(), keys.cuda())
        assert on_cuda.dtype == torch.bfloat16
        assert torch.equal(on_cuda.cpu(), round_merge_hashed(delta, weight, keys))
    assert (rounding_keys(0, 0) < 0).all()


def test_async_compiled_training_scores_both_sides_of_the_ratio_with_one_graph(
    build_trainer, make_cfg, tmp_path_factory
):
    """trainer.async_rollout with a started replica (eager, as every rollout server) and a compiled
    trainer, as the docs recommend (algorithm.old_log_prob=recompute): the ratio's two sides are
    the trainer's compiled graph (each update's first optimizer step has ratio exactly 1, no pair
    clipped), the server's eager log-probs entering only the behaviour weight. Prints the
    eager-vs-compiled gap (step 1's fresh rows) and the behaviour weights of the stale steps."""
    cfg = _tiny_bf16_cuda_cfg(
        make_cfg,
        tmp_path_factory,
        "sd3",
        "engine.compile=true",
        "trainer.lora.enabled=true",
        "trainer.lr=0.01",
        "trainer.updates_per_step=2",
        "algorithm.old_log_prob=recompute",
        "rollout.num_replicas=1",
        "trainer.async_rollout=true",
        "rollout.sampling.guidance_scale=2.0",
        "trainer.total_steps=3",
        output="gpu-async-compiled",
    )
    trainer = build_trainer(cfg)
    assert trainer.engine.compiled_modules
    summary = trainer.fit()
    records = [
        json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if '"reward/mean"' in line
    ]
    print(
        "async compiled: eager-server vs compiled-trainer log-prob gap (step 1, fresh rows) mean "
        f"{records[0]['actor/logprob_gap_mean']:.3g} max {records[0]['actor/logprob_gap_max']:.3g}; "
        "behaviour weight mean per stale step",
        [round(r["actor/behaviour_weight_mean"], 5) for r in records[1:]],
        "capped",
        [r["actor/behaviour_capped_mean"] for r in records[1:]],
        "clipfrac per step",
        [(r["actor/clipfrac_first_step"], r["actor/clipfrac_step_2"]) for r in records],
        "staleness",
        [(r["rollout/staleness_mean"], r["rollout/staleness_max"]) for r in records],
    )
    assert [r["rollout/staleness_max"] for r in records] == [1, 3, 3]
    for record in records:
        assert record["actor/clipfrac_first_step"] == 0.0  # both sides: the trainer's compiled graph
        assert record["actor/ratio_max"] < 1.5
    assert records[0]["actor/logprob_gap_max"] < 0.05  # eager vs compiled, bf16: rounding only
    for record in records[1:]:
        assert 0.0 < record["actor/behaviour_weight_mean"] < 5.0
