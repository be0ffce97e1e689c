"""`flowrl bench train` on the tiny random-weight models (CPU): the recipes' whole step through the
real entry point, the peer loop's fairness (its log-probs are flowrl's), and the FLOP model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.cli import main

REPO = Path(__file__).resolve().parents[2]
# A recipe shrunk to the tiny models: what the GPU suite passes, at 64 px and a few steps.
TINY = [
    "model.dtype=float32",
    "model.device=cpu",
    "model.max_sequence_length=16",
    "reward.name=jpeg_compressibility",
    "data.train_path=null",
    "data.val_path=null",
    "trainer.prompts_per_step=2",
    "rollout.n=2",
    "rollout.sampling.height=64",
    "rollout.sampling.width=64",
    "rollout.val_sampling.height=64",
    "rollout.val_sampling.width=64",
    "rollout.val_sampling.num_inference_steps=2",
    "trainer.mixed_precision=no",
    "engine.compile=false",
]
QWEN = ["model.path=random:tiny-qwen", "rollout.sampling.num_inference_steps=6", "trainer.micro_batch_size=2"]
SD35 = ["model.path=random:tiny-sd3", "rollout.sampling.num_inference_steps=3", "trainer.num_val_images=2"]
FLUX = ["model.path=random:tiny-flux", "rollout.sampling.num_inference_steps=3", "rollout.sampling.guidance_scale=3.5"]
Z_IMAGE = [
    "model.path=random:tiny-z-image",
    "rollout.sampling.num_inference_steps=6",
    "trainer.micro_batch_size=2",
    "rollout.merge_lora=false",
]


def _bench(tmp_path, recipe: str, overrides: list[str], *flags: str) -> tuple[int, dict]:
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--config", str(REPO / "recipes" / recipe), *TINY, *overrides]
    code = main([*argv, "--steps", "2", "--peak-seconds", "0.02", "--json", str(out), *flags])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_sd35_recipe_step_with_the_peer_and_validation(tmp_path, capsys):
    code, report = _bench(tmp_path, "sd35_medium_ocr_lora.yaml", [*SD35, "trainer.val_every=1"])
    assert code == 0, report.get("error")
    assert report["settings"]["random_weights"] == "tiny-sd3"
    flowrl, peer = report["flowrl"], report["peer"]
    assert set(flowrl["phases"]) == {"rollout", "reward_wait", "old_log_prob", "update", "weight_sync", "validation"}
    assert set(peer["phases"]) == {"rollout", "reward_wait", "old_log_prob", "update"}
    assert len(flowrl["steps"]) == 2 and len(peer["steps"]) == 1
    for summary in (flowrl, peer):
        assert summary["step_seconds"] > 0 and summary["images_per_second"] > 0
        for name in ("rollout", "old_log_prob", "update"):
            phase = summary["phases"][name]
            assert phase["flops"] > 0 and 0 < phase["mfu"] and phase["limit_seconds"] > 0, name
    # The same algorithm has the same FLOPs: both loops trained every sample of the step.
    assert flowrl["phases"]["update"]["flops"] == peer["phases"]["update"]["flops"]
    units, s = report["flops"], report["settings"]
    samples, rows = s["samples_per_step"], s["rows_per_sample"]
    assert rows == 2 and s["trained_steps_per_sample"] == 2  # CFG 4.5; every step but the last trained
    assert flowrl["phases"]["rollout"]["flops"] == samples * (
        3 * rows * units["forward_per_row"] + units["decode_per_image"]
    )
    limits = sum(p["limit_seconds"] for name, p in flowrl["phases"].items() if name != "validation")
    assert flowrl["step_over_limits"] == pytest.approx(flowrl["step_seconds"] / limits)
    assert report["peer_over_flowrl"] == pytest.approx(peer["step_seconds"] / flowrl["step_seconds"])
    projection = report["projection"]
    assert projection["validation_included"] and projection["total_steps"] == 1000
    # The recipe file's 8 x 16 samples per step, scaled from the 2 x 2 run.
    assert projection["hours_at_recipe_size"] == pytest.approx(projection["hours"] * 128 / 4)
    printed = capsys.readouterr()
    assert "RANDOM WEIGHTS" in printed.err
    assert "| update |" in printed.out and "the peer's training step takes" in printed.out
    # The warm-up step (what a run's first step costs) is kept apart from the timed ones.
    assert flowrl["warmup"]["step"] == 1 and [s["step"] for s in flowrl["steps"]] == [2, 3]
    assert "flowrl's first step" in printed.out


def test_qwen_recipe_step_without_the_peer(tmp_path, capsys):
    code, report = _bench(tmp_path, "qwen_image_ocr_lora.yaml", QWEN, "--peer-steps", "0")
    assert code == 0, report.get("error")
    assert "peer" not in report and "peer_over_flowrl" not in report
    assert report["settings"]["window"] == 2 and report["settings"]["rows_per_sample"] == 2
    assert "validation" not in report["flowrl"]["phases"]  # val_every 50 > the steps run
    assert not report["projection"]["validation_included"]
    flowrl = report["flowrl"]
    assert [s["step"] for s in flowrl["steps"]] == [2, 3]
    assert 0 <= flowrl["steps"][-1]["old_log_prob_early_share"] <= 1  # the recipe recomputes
    printed = capsys.readouterr().out
    assert "the peer" not in printed
    assert flowrl["rollout_alone_seconds"] > 0 and "the rollout alone" in printed


def test_a_merged_rollout_counts_forwards_without_the_low_rank_terms_and_the_merge(tmp_path, capsys):
    """rollout.merge_lora: the rollout's limit is its forwards on the merged weights plus one
    merge; the recompute's forwards still run the adapter."""
    code, report = _bench(tmp_path, "qwen_image_ocr_lora.yaml", [*QWEN, "rollout.merge_lora=true"], "--peer-steps", "0")
    printed = capsys.readouterr().out
    assert code == 0, report.get("error")
    units, s, phases = report["flops"], report["settings"], report["flowrl"]["phases"]
    assert 0 < units["rollout_forward_per_row"] < units["forward_per_row"]
    assert units["merge_per_rollout"] > 0
    forwards = s["steps"] * s["rows_per_sample"] * units["rollout_forward_per_row"]
    assert (
        phases["rollout"]["flops"]
        == s["samples_per_step"] * (forwards + units["decode_per_image"]) + units["merge_per_rollout"]
    )
    assert phases["old_log_prob"]["flops"] % units["forward_per_row"] == 0
    # The merge's own seconds, part of the rollout phase, are kept per step and printed.
    steps = report["flowrl"]["steps"]
    assert all(0 < step["lora_merge_seconds"] < step["seconds"]["rollout"] for step in steps)
    assert "| rollout" in printed


def test_a_forward_process_step_counts_its_own_phases(tmp_path, capsys):
    """DiffusionNFT: no peer by default; the old-velocity phase counts one forward per trained
    (sample, timestep) pair for the old adapter and one for the KL reference, the update one
    forward + backward per pair (its int(0.99 x 3) = 2 timesteps a sample, not an SDE window's)."""
    code, report = _bench(tmp_path, "sd35_medium_ocr_nft.yaml", SD35)
    assert code == 0, report.get("error")
    assert "peer" not in report and report["settings"]["peer_steps"] == 0
    units, s, phases = report["flops"], report["settings"], report["flowrl"]["phases"]
    assert s["trained_steps_per_sample"] == 2
    pairs = s["samples_per_step"] * 2
    assert phases["old_log_prob"]["flops"] == pairs * s["rows_per_sample"] * units["forward_per_row"] * 2
    assert phases["update"]["flops"] == pairs * units["train_per_sample_step"]


@pytest.mark.parametrize(
    "recipe, overrides, rows",
    [("sd35_medium_ocr_lora.yaml", FLUX, 1), ("z_image_ocr_lora.yaml", Z_IMAGE, 2)],
    ids=["flux", "z_image"],
)
def test_step_flops_follow_the_adapters_rows(tmp_path, recipe, overrides, rows):
    """FLUX.1 [dev]'s guidance goes into its guidance embedding, one row per sample; Z-Image's CFG
    takes two: the rollout's FLOPs follow the adapter's rule. (The FLUX recipe's PickScore options
    cannot be overridden away, so FLUX runs the SD3.5 recipe, whose LoRA targets it has.)"""
    code, report = _bench(tmp_path, recipe, overrides, "--peer-steps", "0")
    assert code == 0, report.get("error")
    s, units, flowrl = report["settings"], report["flops"], report["flowrl"]
    assert s["random_weights"] == overrides[0].removeprefix("model.path=random:")
    assert s["rows_per_sample"] == units["rows_per_sample"] == rows
    assert flowrl["phases"]["rollout"]["flops"] == s["samples_per_step"] * (
        s["steps"] * rows * units["forward_per_row"] + units["decode_per_image"]
    )
    assert flowrl["phases"]["update"]["flops"] > 0


@pytest.mark.parametrize(
    "args, named",
    [
        (["model.path=random:no-such-model"], "model.path='random:no-such-model'"),
        (["model.path=random:tiny-sd3", "--peer-steps", "-1"], "--peer-steps=-1"),
        (["model.path=random:tiny-sd3", "algorithm.name=diffusion_nft", "--peer-steps", "1"], "--peer-steps=1"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, named):
    recipe = "sd35_medium_ocr_nft.yaml" if "algorithm.name=diffusion_nft" in args else "sd35_medium_ocr_lora.yaml"
    code = main(["bench", "train", "--config", str(REPO / "recipes" / recipe), *TINY, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0]


@pytest.mark.parametrize(
    "recipe, overrides, rows",
    [
        ("sd35_medium_ocr_lora.yaml", SD35, 2),
        ("sd35_medium_ocr_lora.yaml", QWEN, 2),
        ("sd35_medium_ocr_lora.yaml", FLUX, 1),  # guidance 4.5 into the guidance embedding
        ("sd35_medium_ocr_lora.yaml", [*FLUX, "rollout.sampling.true_cfg_scale=2.0"], 2),
        ("z_image_ocr_lora.yaml", Z_IMAGE, 2),
    ],
    ids=["sd3", "qwen_image", "flux", "flux_true_cfg", "z_image"],
)
def test_peer_log_probs_are_flowrls(recipe, overrides, rows, tmp_path):
    """The peer's SDE step is written out from the formula, not taken from flowrl.sampler: its
    log-probs must be those flowrl's trainer computes for the same transitions, rollout and
    re-scoring alike, or the two loops would not compute the same thing; with the adapter's
    guidance rule (CFG rows, FLUX's guidance embedding and true CFG) as the engine applies it."""
    from flowrl.bench.peer import PeerLoop
    from flowrl.bench.train import load_bench_config
    from flowrl.engine.output import TransitionSpec
    from flowrl.models.base import pad_encodings
    from flowrl.run.checks import build_engine, check_before_loading
    from flowrl.run.step_flops import trainable
    from flowrl.trainer.logprob import score_transitions

    cfg = load_bench_config(str(REPO / "recipes" / recipe), [*TINY, *overrides], str(tmp_path / "run"))
    prepared = check_before_loading(cfg)
    adapter = build_engine(cfg).adapter
    with trainable(adapter.transformer, cfg.trainer) as params:
        peer = PeerLoop(adapter, cfg, prepared.reward, params)
        rollout, futures = peer.rollout(prepared.train_rows[:2], 2)
        peer.close()
        assert all(np.isfinite(f.result()[0]).all() for f in futures)
        embeds, mask, pooled = pad_encodings(rollout.cond)
        tensors = {
            "all_latents": rollout.latents,
            "sigmas": rollout.sigmas,
            "next_sigmas": rollout.next_sigmas,
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
        }
        if pooled is not None:
            tensors.update(pooled_prompt_embeds=pooled)
        assert peer.rows_per_sample == rows and (rollout.uncond[0] is not None) == (rows == 2)
        if rows == 2:
            neg_embeds, neg_mask, neg_pooled = pad_encodings(rollout.uncond)
            tensors.update(negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=neg_mask)
            if neg_pooled is not None:
                tensors.update(negative_pooled_prompt_embeds=neg_pooled)
        spec = TransitionSpec.of(cfg.rollout.sampling)
        rows = torch.arange(rollout.latents.shape[0])
        with torch.no_grad():
            for j in range(rollout.log_probs.shape[1]):
                steps = torch.full_like(rows, j)
                flowrl = score_transitions(adapter, tensors, steps, spec).log_prob
                rescored = peer.score(rollout, rows, steps)[0]
                torch.testing.assert_close(flowrl, rollout.log_probs[:, j], rtol=0, atol=2e-5)
                torch.testing.assert_close(rescored, flowrl, rtol=0, atol=2e-5)


def test_peer_sde_step_is_the_samplers():
    from flowrl import sampler
    from flowrl.bench.peer import gaussian_log_prob, sde_gaussian

    gen = torch.Generator().manual_seed(0)
    x, v, nxt = (torch.randn(3, 4, 8, 8, generator=gen) for _ in range(3))
    s, s_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1])
    mean, std, std_t = sde_gaussian(x, v, s, s_next, 0.7, sigma_1=0.8)
    reference = sampler.sde_step(x, v, s, s_next, 0.7, next_latents=nxt, sigma_first_step=0.8)
    torch.testing.assert_close(mean, reference.mean)
    torch.testing.assert_close(std.flatten(), reference.std)
    torch.testing.assert_close(std_t.flatten(), reference.kl_std)
    torch.testing.assert_close(gaussian_log_prob(nxt, mean, std), reference.log_prob)


def test_phase_flops_follow_the_algorithm():
    from flowrl.run.config import load_train_config
    from flowrl.run.step_flops import UnitFlops
    from flowrl.trainer.flow_grpo import phase_flops

    units = UnitFlops(10, 3, 25, 10, 3, rows_per_sample=2, val_rows_per_sample=2)  # both recipes run CFG
    cfg = load_train_config(str(REPO / "recipes" / "qwen_image_ocr_lora.yaml"), ["trainer.prompts_per_step=2"])
    flops = phase_flops(units, cfg, rows_trained=20, val_images=4)
    assert flops["rollout"] == 32 * (10 * 2 * 10 + 3)  # 32 samples, 10 steps of 2 rows, one decode each
    # recompute: the second optimizer step's samples (the first scores its own) x window 2 x 2 rows
    assert flops["old_log_prob"] == 10 * 2 * 2 * 10
    assert flops["update"] == 20 * 2 * 25  # no KL term in this recipe
    assert flops["validation"] == 4 * (50 * 2 * 10 + 3)
    assert flops["reward_wait"] == flops["weight_sync"] == 0
    sd35 = load_train_config(str(REPO / "recipes" / "sd35_medium_ocr_lora.yaml"), [])
    flops = phase_flops(units, sd35, rows_trained=1)
    assert flops["update"] == 9 * (25 + 2 * 10)  # 9 trained steps, each with the KL reference's forward
    assert flops["old_log_prob"] == 0  # its one sample is the first optimizer step's
    assert phase_flops(units, sd35, rows_trained=5)["old_log_prob"] == 2 * 9 * 2 * 10  # 3 + 2 samples
    assert "validation" not in flops


def test_trainable_leaves_the_model_as_it_was():
    """The bench sets the trainer's LoRA up on the bare model to count and to run the peer, then
    hands the trainer the same modules: nothing of the setup may stay behind."""
    from flowrl.models.lora import has_lora
    from flowrl.models.registry import load_adapter
    from flowrl.run.config import load_train_config
    from flowrl.run.step_flops import trainable

    adapter = load_adapter("random:tiny-sd3", warn=False)
    before = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters()}
    cfg = load_train_config(str(REPO / "recipes" / "sd35_medium_ocr_lora.yaml"), [])
    with trainable(adapter.transformer, cfg.trainer) as params:
        assert has_lora(adapter.transformer) and params and all(p.requires_grad for p in params)
    after = dict(adapter.transformer.named_parameters())
    assert not has_lora(adapter.transformer) and set(after) == set(before)
    assert all(torch.equal(after[n], before[n]) and not after[n].requires_grad for n in before)


def test_a_failing_peer_keeps_flowrls_figures(tmp_path, capsys):
    """The peer implements the sde step only: with cps it fails, and flowrl's step is still measured."""
    code, report = _bench(tmp_path, "sd35_medium_ocr_lora.yaml", [*SD35, "rollout.sampling.sde_type=cps"])
    assert code == 1
    assert "sde_type='cps'" in report["peer"]["error"] and report["flowrl"]["step_seconds"] > 0
    assert "the peer's loop failed" in capsys.readouterr().out


def test_the_peer_refuses_the_ode_tail_settings_it_would_not_honour():
    """It takes every step outside the window with Euler: a Flash recipe fails the peer alone."""
    from flowrl.bench.peer import check_peer_sampling
    from flowrl.run.config import load_train_config

    cfg = load_train_config(str(REPO / "recipes" / "qwen_image_mixgrpo_flash_lora.yaml"), [])
    with pytest.raises(ValueError, match=r"ode_solver='dpmpp_2m', ode_tail_ratio=0\.4: the peer loop .*--peer-steps 0"):
        check_peer_sampling(cfg.rollout.sampling)
    check_peer_sampling(cfg.rollout.sampling.replace(ode_solver="euler", ode_tail_ratio=1.0))


@pytest.mark.gpu
def test_bench_train_on_cuda_in_bf16(tmp_path):
    """The CUDA paths (device generators, host row indices into device tensors, bf16 autocast, peak
    memory) on the tiny model, eager: seconds of GPU time."""
    cuda = [o for o in TINY if not o.startswith(("model.dtype", "model.device", "trainer.mixed_precision"))]
    out = tmp_path / "train.json"
    recipe = str(REPO / "recipes" / "qwen_image_ocr_lora.yaml")
    argv = ["bench", "train", "--config", recipe, *cuda, *QWEN, "model.device=cuda", "model.dtype=bfloat16"]
    assert main([*argv, "--steps", "1", "--peak-seconds", "0.1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["flowrl"]["peak_memory_gb"] > 0 and report["peer"]["peak_memory_gb"] > 0
    for loop in ("flowrl", "peer"):
        assert report[loop]["peak_memory_reserved_gb"] >= report[loop]["peak_memory_gb"]
    assert report["peer_over_flowrl"] > 0


def test_a_run_stopped_after_its_timed_steps_keeps_their_summary(tmp_path, monkeypatch):
    """A bench stopped by its time limit after its timed steps (here: while it times the rollout
    alone) leaves a JSON whose flowrl summary covers the steps it timed, and the markdown reports them."""
    import flowrl.bench.train as bench_train

    class Stopped(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(bench_train, "_rollout_alone", stop)
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--config", str(REPO / "recipes" / "qwen_image_ocr_lora.yaml"), *TINY, *QWEN]
    with pytest.raises(Stopped):
        main([*argv, "--steps", "2", "--peer-steps", "0", "--peak-seconds", "0.02", "--json", str(out)])
    report = json.loads(out.read_text())
    flowrl = report["flowrl"]
    assert [s["step"] for s in flowrl["steps"]] == [2, 3]
    assert flowrl["step_seconds"] == pytest.approx(np.median([s["step_seconds"] for s in flowrl["steps"]]))
    assert set(flowrl["phases"]) >= {"rollout", "old_log_prob", "update"}
    assert "rollout_alone_seconds" not in flowrl and "projection" not in report
    table = "\n".join(bench_train.train_lines(report))
    assert f"| **training step** (validation apart) | {flowrl['step_seconds']:.2f} |" in table


def test_published_random_weights_on_a_cpu_are_refused_before_anything_is_built(monkeypatch, capsys):
    """The README's command on a CPU-only machine: no GPU, so a 20 B model would be built in host
    memory for minutes; it is refused at once, saying what it would need (issue 52)."""
    import flowrl.models.debug.random_weights as random_weights

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def refuse(*args, **kwargs):
        raise AssertionError("a published-size model was built before the refusal")

    monkeypatch.setattr(random_weights, "build_random_module", refuse)
    argv = ["bench", "train", "--config", str(REPO / "recipes" / "qwen_image_ocr_lora.yaml")]
    argv += ["model.path=random:qwen-image", "reward.name=jpeg_compressibility", "data.train_path=null"]
    assert main([*argv, "data.val_path=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowrl bench train: error: model.path='random:qwen-image'")
    assert "needs a GPU" in err[0] and "20.6 B parameters" in err[0] and "41 GB in bfloat16" in err[0]
    assert "model.path=random:tiny-qwen" in err[0]


def test_a_video_recipes_header_names_its_frames_and_counts_videos():
    """A Wan run's table says "240x416, 33 frames" and videos/s (it read "240px" and img/s)."""
    import flowrl.bench.train as bench_train

    settings = {"config": "wan.yaml", "size": 240, "height": 240, "width": 416, "num_frames": 33}
    phase = {"seconds": 2.0, "limit_seconds": 1.0, "mfu": 0.5}
    flowrl = {"phases": {"rollout": phase}, "step_seconds": 2.0, "limit_seconds": 1.0, "mfu": 0.5}
    flowrl.update(images_per_second=4.0, step_over_limits=2.0)
    text = "\n".join(bench_train.train_lines({"settings": settings, "flowrl": flowrl}))
    assert "240x416, 33 frames," in text and "4.000 videos/s over the whole step" in text
    image = dict(settings, height=512, width=512, num_frames=1)
    text = "\n".join(bench_train.train_lines({"settings": image, "flowrl": flowrl}))
    assert "512px," in text and "4.000 img/s over the whole step" in text


WAN = [
    "model.path=random:tiny-wan",
    "reward.options.reward=jpeg_compressibility",
    "rollout.sampling.num_inference_steps=3",
    "rollout.sampling.num_frames=9",
    "rollout.val_sampling.num_frames=9",
]


def test_a_video_runs_units_and_peer_take_its_frames(tmp_path):
    """The training pass's FLOP unit and the peer's rollout run at the recipe's frame count: both
    once ran on one-frame latents (a backward counted at a third of the 9-frame forward; the
    peer's step timed on single frames), so a Wan step's update limit and its peer were wrong."""
    from flowrl.bench.peer import PeerLoop
    from flowrl.bench.train import load_bench_config
    from flowrl.run.checks import build_engine, check_before_loading
    from flowrl.run.step_flops import count_unit_flops, trainable

    tiny_wan = [o for o in TINY if o != "reward.name=jpeg_compressibility"]
    cfg = load_bench_config(str(REPO / "recipes" / "wan21_1_3b_ocr_lora.yaml"), [*tiny_wan, *WAN], str(tmp_path))
    prepared = check_before_loading(cfg)
    adapter = build_engine(cfg).adapter
    s = cfg.rollout.sampling
    with trainable(adapter.transformer, cfg.trainer) as params:
        units = count_unit_flops(adapter, cfg, "a red circle")
        # LoRA's backward: about one more forward (activation gradients), on the same 9 frames.
        assert units.train_per_sample_step > 1.5 * units.rows_per_sample * units.forward_per_row
        peer = PeerLoop(adapter, cfg, prepared.reward, params)
        rollout, futures = peer.rollout(prepared.train_rows[:1], 2)
        peer.close()
    frames = adapter.latent_frames(s.num_frames)
    assert rollout.latents.shape[-3] == frames and rollout.latents.shape[:2] == (2, rollout.log_probs.shape[1] + 1)
    assert all(np.isfinite(f.result()[0]).all() for f in futures)
