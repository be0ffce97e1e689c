"""CLI smoke tests of `flowrl bench rollout` and `flowrl bench logprob` on the tiny models (CPU),
through the real entry point, checking the properties the reports promise."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.cli import main


def test_bench_rollout_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    code = main(
        [
            "bench",
            "rollout",
            "--model",
            "tiny-sd3",
            "-n",
            "3",
            "--steps",
            "3",
            "--size",
            "64",
            "--guidance-scale",
            "2.0",
            "--serial-samples",
            "2",
            "--peak-seconds",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["pipeline-serial", "pipeline-batched", "engine-batched", "engine-concurrent"]
    for name, mode in modes.items():
        assert mode["images_per_second"] > 0 and 0 < mode["mfu"], name
    assert modes["pipeline-serial"]["images_per_run"] == 2
    # generate_batched: every forward carries all 3 samples' cond + uncond rows, one per step.
    assert modes["engine-batched"]["rows_per_forward_hist"] == {"6": 3}
    # Concurrent single requests must share forwards (trap: batching silently off).
    assert modes["engine-concurrent"]["mean_rows_per_forward"] > 2
    flops = report["flops"]
    assert flops["per_image"] == 3 * 2 * flops["transformer_per_row"] + flops["decode_per_image"]
    assert "engine-batched / pipeline-batched" in report["ratios"]
    assert "engine-concurrent / engine-batched" in capsys.readouterr().out


def test_bench_rollout_with_lora_runs_the_adapter(tmp_path, capsys):
    """--lora-rank rolls out with the trainer's adapter in place (as a training run's rollouts do):
    the attention projections are LoRA layers in every mode, and the report says so."""
    from flowrl.bench import rollout as rollout_bench

    built = []
    real_init = rollout_bench.RolloutBench.__init__

    def recording_init(self, args):
        real_init(self, args)
        built.append(self.bench.adapter.transformer)

    out = tmp_path / "rollout.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_bench.RolloutBench, "__init__", recording_init)
        code = main(
            [
                "bench",
                "rollout",
                "--model",
                "tiny-qwen",
                "-n",
                "2",
                "--steps",
                "2",
                "--size",
                "64",
                "--modes",
                "engine-batched",
                "--lora-rank",
                "4",
                "--peak-seconds",
                "0.05",
                "--json",
                str(out),
            ]
        )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"]["lora_rank"] == 4 and report["modes"]["engine-batched"]["images_per_second"] > 0
    to_q = built[0].transformer_blocks[0].attn.to_q
    assert type(to_q) is not torch.nn.Linear and to_q.r["default"] == 4  # a peft LoRA layer of rank 4
    assert "LoRA rank 4" in capsys.readouterr().out


def test_bench_logprob_gap_is_rounding_on_cpu(tmp_path):
    out = tmp_path / "logprob.json"
    code = main(
        [
            "bench",
            "logprob",
            "--model",
            "tiny-qwen",
            "-n",
            "4",
            "--steps",
            "3",
            "--size",
            "64",
            "--micro-batches",
            "1,4",
            "--lora-rank",
            "4",
            "--train-repeats",
            "1",
            "--peak-seconds",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    gaps = {g["micro_batch"]: g for g in report["gaps"]}
    assert set(gaps) == {1, 4}
    for gap in gaps.values():  # float32 on CPU: only batch-shape rounding separates the two paths
        assert gap["trainer_values_from"] == "grad pass"  # eager: one graph
        assert gap["max_abs_diff"] < 1e-5 and gap["grad_pass"]["max_abs_diff"] == gap["max_abs_diff"]
        assert gap["no_grad_pass"]["max_abs_diff"] < 1e-5
        assert len(gap["max_abs_diff_per_step"]) == 2  # window: every step but the last
    [step] = report["training_steps"]  # default: the largest micro-batch that fit
    assert step["micro_batch"] == 4 and step["flops_forward_backward"] > 0 and step["optimizer_step_included"]


def test_bench_logprob_gradient_checkpointing_recomputes_and_profile_reports(tmp_path, capsys):
    """--gradient-checkpointing times the step as the recipes train: the forward is run again in
    the backward (more FLOPs executed), and the log-probs are unchanged. --profile adds one
    profiled step to the report and the printout."""

    def bench(name, *extra):
        out = tmp_path / f"{name}.json"
        assert (
            main(
                [
                    "bench",
                    "logprob",
                    "--model",
                    "tiny-qwen",
                    "-n",
                    "2",
                    "--steps",
                    "3",
                    "--size",
                    "64",
                    "--micro-batches",
                    "2",
                    "--lora-rank",
                    "4",
                    "--train-repeats",
                    "1",
                    "--peak-seconds",
                    "0.05",
                    "--json",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        return json.loads(out.read_text())

    plain = bench("plain")
    checkpointed = bench("checkpointed", "--gradient-checkpointing", "--profile")
    assert checkpointed["settings"]["gradient_checkpointing"] and not plain["settings"]["gradient_checkpointing"]
    flops = [r["training_steps"][0]["flops_forward_backward"] for r in (plain, checkpointed)]
    assert flops[1] > flops[0] * 1.2, flops  # the recomputed forward is counted
    assert checkpointed["gaps"][0]["max_abs_diff"] < 1e-5
    profile = checkpointed["training_steps"][0]["profile"]
    assert profile["total_ms"] > 0 and profile["top_kernels"] and "gpu_busy" not in profile  # CPU: no busy share
    assert "profile" not in plain["training_steps"][0]
    printed = capsys.readouterr().out
    assert "profile of one training step" in printed and "gradient checkpointing" in printed


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--modes", "engine-batched,warp-drive"], "--modes"),
        (["--num-layers", "2"], "--num-layers"),
        (["--lora-rank", "-1"], "--lora-rank"),
    ],
)
def test_bench_rollout_bad_input_names_the_flag(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        main(["bench", "rollout", "--model", "tiny-sd3", "--size", "64", "--steps", "1", *argv])


def test_bench_logprob_bad_micro_batches():
    with pytest.raises(ValueError, match="--micro-batches"):
        main(["bench", "logprob", "--model", "tiny-sd3", "--micro-batches", "0,x"])
    with pytest.raises(ValueError, match="--train-micro-batches='1,0'"):
        main(["bench", "logprob", "--model", "tiny-sd3", "--train-micro-batches", "1,0"])
    with pytest.raises(ValueError, match="--train-micro-batches='2,8'.*raise -n \\(now 4\\)"):
        main(["bench", "logprob", "--model", "tiny-sd3", "-n", "4", "--train-micro-batches", "2,8"])
    for bad in (["--kl-beta", "-0.1"], ["--kl-beta", "0.04", "--lora-rank", "0"]):
        with pytest.raises(ValueError, match="--kl-beta=.*--lora-rank > 0"):
            main(["bench", "logprob", "--model", "tiny-sd3", *bad])


def test_bench_logprob_flop_count_out_of_memory_falls_back_to_one_sample(tmp_path, monkeypatch, capsys):
    """The eager FLOP count of a large micro-batch can run out of memory where the compiled step
    fit (run 46, micro-batch 8). It is then counted on one sample and scaled, which is exact (every
    row has the same shapes), and the report says so."""
    from flowrl.bench import flops as flop_count

    def bench(name):
        out = tmp_path / f"{name}.json"
        assert (
            main(
                [
                    "bench",
                    "logprob",
                    "--model",
                    "tiny-sd3",
                    "-n",
                    "3",
                    "--steps",
                    "2",
                    "--size",
                    "64",
                    "--micro-batches",
                    "3",
                    "--lora-rank",
                    "2",
                    "--train-repeats",
                    "1",
                    "--peak-seconds",
                    "0.05",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        return json.loads(out.read_text())["training_steps"][0]

    direct = bench("direct")
    count, calls = flop_count.count_flops, []

    def out_of_memory_once(fn):
        calls.append(fn)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB")
        return count(fn)

    monkeypatch.setattr(flop_count, "count_flops", out_of_memory_once)
    scaled = bench("scaled")
    assert len(calls) == 2 and direct["flops_counted_at_micro_batch"] == 3
    assert scaled["flops_counted_at_micro_batch"] == 1
    assert scaled["flops_forward_backward"] == direct["flops_forward_backward"] > 0
    assert "(counted at micro-batch 1, scaled)" in capsys.readouterr().out


def test_bench_logprob_times_each_training_micro_batch(tmp_path, capsys):
    """--train-micro-batches times a step at each size, in one process: one entry per size, each with
    its own FLOPs (which grow with the micro-batch) and a line in the printout."""
    out = tmp_path / "logprob.json"
    assert (
        main(
            [
                "bench",
                "logprob",
                "--model",
                "tiny-sd3",
                "-n",
                "4",
                "--steps",
                "2",
                "--size",
                "64",
                "--micro-batches",
                "4",
                "--train-micro-batches",
                "1,4",
                "--lora-rank",
                "2",
                "--train-repeats",
                "1",
                "--peak-seconds",
                "0.05",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    steps = json.loads(out.read_text())["training_steps"]
    assert [s["micro_batch"] for s in steps] == [1, 4]
    assert steps[1]["flops_forward_backward"] > 3 * steps[0]["flops_forward_backward"] > 0
    printed = capsys.readouterr().out
    assert "training step, micro-batch 1:" in printed and "training step, micro-batch 4:" in printed
    assert "ms per sample" in printed


def test_compiled_rollout_and_trainer_log_probs_agree_in_bf16(tmp_path):
    """Inductor compiles the rollout (no grad, engine thread) and the trainer's forward (grad, this
    thread) as different graphs. Both must round bf16 intermediates where eager does, whichever
    thread compiles: without that the gap here was mean 4.8e-5, max 3.4e-4."""
    out = tmp_path / "logprob.json"
    code = main(
        [
            "bench",
            "logprob",
            "--model",
            "tiny-qwen",
            "-n",
            "4",
            "--steps",
            "4",
            "--size",
            "64",
            "--micro-batches",
            "1,4",
            "--lora-rank",
            "4",
            "--train-repeats",
            "1",
            "--peak-seconds",
            "0.05",
            "--dtype",
            "bfloat16",
            "--compile",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"]["compile"] == "inductor"
    for gap in report["gaps"]:
        assert gap["trainer_values_from"] == "no_grad pass"  # compiled: the trainer's values (flowrl.trainer.policy)
        for figures in (gap, gap["no_grad_pass"], gap["grad_pass"]):
            assert figures["max_abs_diff"] <= 1e-6, gap


def test_mixed_precision_rollout_matches_the_trainer(tmp_path):
    """float32 weights, trainer under bf16 autocast: the engine runs under the same autocast, so
    the gap is rounding-free (it was mean 6.7e-5, max 1.8e-4 with the rollout in float32)."""
    out = tmp_path / "logprob.json"
    code = main(
        [
            "bench",
            "logprob",
            "--model",
            "tiny-qwen",
            "-n",
            "4",
            "--steps",
            "4",
            "--size",
            "64",
            "--micro-batches",
            "1,4",
            "--lora-rank",
            "4",
            "--train-repeats",
            "1",
            "--peak-seconds",
            "0.05",
            "--dtype",
            "float32",
            "--autocast",
            "bf16",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    for gap in json.loads(out.read_text())["gaps"]:
        assert gap["max_abs_diff"] <= 1e-6, gap


def test_summary_prints_every_benchmark_file(tmp_path, capsys):
    """python -m flowrl.bench.summary (what benchmarks/gpu_suites.sh prints last): one markdown section per file,
    the rollout's LoRA rank and every timed training step shown, an unreadable file named."""
    from flowrl.bench import summary

    rollout, logprob, broken = tmp_path / "r.json", tmp_path / "l.json", tmp_path / "cut.json"
    assert (
        main(
            [
                "bench",
                "rollout",
                "--model",
                "tiny-sd3",
                "-n",
                "2",
                "--steps",
                "2",
                "--size",
                "64",
                "--modes",
                "engine-batched",
                "--lora-rank",
                "2",
                "--peak-seconds",
                "0.05",
                "--json",
                str(rollout),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "bench",
                "logprob",
                "--model",
                "tiny-sd3",
                "-n",
                "2",
                "--steps",
                "2",
                "--size",
                "64",
                "--micro-batches",
                "2",
                "--train-repeats",
                "2",
                "--peak-seconds",
                "0.05",
                "--json",
                str(logprob),
            ]
        )
        == 0
    )
    broken.write_text('{"benchmark": "rollout", "settings": {')  # a file cut short mid-write
    capsys.readouterr()
    assert summary.main([str(rollout), str(logprob), str(broken)]) == 0
    out = capsys.readouterr().out
    assert "### r: tiny-sd3, 2 samples" in out and "LoRA rank 2, " in out and "| engine-batched |" in out
    runs = json.loads(logprob.read_text())["training_steps"][0]["seconds"]
    assert f"(runs: {summary.ms_list(runs)})" in out and len(runs) == 2
    assert "### cut.json: unreadable" in out


def test_busy_within_span_is_the_union_of_device_intervals():
    """Overlapping and nested device intervals count once, the gaps between them are idle, host
    events and the device copies of host annotations (same name as a host event) are left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from flowrl.bench.report import busy_within_span

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("gemm", 0, 400),
        event("copy", 300, 500),
        event("norm", 350, 450),  # 0-500 busy
        event("attention", 800, 1000),  # 300 idle, 200 busy
        event("Optimizer.step", 0, 5000, DeviceType.CPU),
        event("Optimizer.step", 0, 2000),
    ]
    span = busy_within_span(events)
    assert (span["span_ms"], span["busy_ms"], span["gaps"]) == (1.0, 0.7, 1) and span["share"] == pytest.approx(0.7)
    assert span["longest_gaps"] == [{"ms": 0.3, "at_ms": 0.5, "after": "copy", "before": "attention"}]
    assert busy_within_span([event("Optimizer.step", 0, 5, DeviceType.CPU)]) is None


@pytest.mark.gpu
def test_profile_counts_each_kernel_once_on_gpu():
    """An eager op on the profiling thread carries its kernel's device time as its own; counting
    both made a training step's GPU busy share 115% (run 34). Only device events count."""
    from flowrl.bench.report import profile_summary

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    profile = profile_summary(lambda: [a @ a for _ in range(4)], torch.device("cuda"))
    names = [k["name"] for k in profile["top_kernels"]]
    assert not any(name.startswith("aten::") for name in names), names
    assert (
        abs(sum(profile["share_by_category"].values()) - 1.0) < 1e-6
        and profile["share_by_category"].get("matmul", 0) > 0.9
    )
    # One stream: kernels never overlap, so the busy union is the kernels' summed time; the
    # launch gaps between them (host time, longer under the profiler) are idle.
    span = profile["busy_within_span"]
    assert span["busy_ms"] == pytest.approx(profile["total_ms"], rel=1e-3)
    assert 0.0 < span["share"] <= 1.0 and span["busy_ms"] <= span["span_ms"]


def test_bench_logprob_recompute_step_runs_no_value_pass(tmp_path):
    """Compiled, --old-log-prob recompute: the timed step takes its values from its grad pass, as
    the trainer does when it recomputes the denominator (in the grad graph), instead of running a
    no-grad forward for them, so it executes fewer FLOPs than the rollout-denominator step, which
    runs the value pass; the reported gap is then the grad pass's. A KL term (--kl-beta) scores
    the same way, as the trainer does, and adds the reference's forward."""

    def bench(mode, *extra):
        out = tmp_path / f"{mode}{len(extra)}.json"
        assert (
            main(
                [
                    "bench",
                    "logprob",
                    "--model",
                    "tiny-qwen",
                    "-n",
                    "2",
                    "--steps",
                    "3",
                    "--size",
                    "64",
                    "--micro-batches",
                    "2",
                    "--lora-rank",
                    "4",
                    "--train-repeats",
                    "1",
                    "--peak-seconds",
                    "0.05",
                    "--compile",
                    "--compile-backend",
                    "eager",  # which pass gives the values follows is_compiled, not the backend
                    "--old-log-prob",
                    mode,
                    *extra,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        return json.loads(out.read_text())

    rollout, recompute = bench("rollout"), bench("recompute")
    kl = bench("recompute", "--kl-beta", "0.04")
    assert kl["settings"]["kl_beta"] == 0.04 and kl["gaps"][0]["trainer_values_from"] == "grad pass"
    assert kl["training_steps"][0]["flops_forward_backward"] > recompute["training_steps"][0]["flops_forward_backward"]
    assert recompute["settings"]["old_log_prob"] == "recompute"
    assert [r["gaps"][0]["trainer_values_from"] for r in (rollout, recompute)] == ["no_grad pass", "grad pass"]
    flops = [r["training_steps"][0]["flops_forward_backward"] for r in (rollout, recompute)]
    # fwd + bwd is about 3 forwards; the value pass adds a fourth
    assert flops[1] < 0.85 * flops[0], flops


def test_bench_logprob_keeps_the_step_timings_when_the_flop_count_dies(tmp_path, monkeypatch):
    """The FLOP count runs the step again, eagerly, under a dispatch mode; a failure there that
    ends the process (a CUDA error poisons the context) must not take the timed step with it: the
    JSON holds the timings, written before the count."""
    from flowrl.bench import flops as flop_count

    class ProcessDied(BaseException):
        pass

    def dies(fn):
        raise ProcessDied()

    monkeypatch.setattr(flop_count, "count_flops", dies)
    out = tmp_path / "logprob.json"
    args = ["bench", "logprob", "--model", "tiny-sd3", "-n", "2", "--steps", "2", "--size", "64"]
    args += ["--micro-batches", "2", "--lora-rank", "2", "--train-repeats", "1", "--peak-seconds", "0.05"]
    with pytest.raises(ProcessDied):
        main([*args, "--json", str(out)])
    [step] = json.loads(out.read_text())["training_steps"]
    assert step["micro_batch"] == 2 and step["seconds_median"] > 0 and "flops_forward_backward" not in step
