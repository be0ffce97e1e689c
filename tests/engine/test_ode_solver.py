"""MixGRPO-Flash's ODE tail in the engine (SamplingParams.ode_solver, ode_tail_ratio): a plain
multistep loop's samples, convergence, batch invariance, window log-probs untouched, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl import sampler
from flowrl.engine import DiffusionEngine, SamplingParams

ATOL = 1e-5
FLASH = dict(sde_window=(1, 3), ode_solver="dpmpp_2m", ode_tail_ratio=0.5)


class FinalLatents:
    """Records the final latent of every sample the engine finishes: `of(output)`, the latest one
    of the output's seed."""

    def __init__(self, engine):
        self.engine, self.inner, self.by_seed = engine, engine.executor.finish, {}

    def __call__(self, samples):
        self.by_seed.update({s.seed: s.latents.clone() for s in samples})
        return self.inner(samples)

    def of(self, output) -> torch.Tensor:
        return self.by_seed[output.seed]

    def __enter__(self):
        self.engine.executor.finish = self
        return self

    def __exit__(self, *exc):
        del self.engine.executor.finish  # back to the class method


def plain_flash_loop(adapter, prompt: str, p: SamplingParams) -> torch.Tensor:
    """The final latent of one sample, written out step by step: Euler before the window, the
    shared SDE step inside it, then DPM-Solver++(2M) from arXiv 2211.01095 (lambda = log(alpha /
    sigma), alpha = 1 - sigma) on the compressed tail, first order on the last step."""
    sigmas = adapter.sigmas(p.num_inference_steps, p.height, p.width).double().numpy()
    steps = p.num_inference_steps
    start, end = p.sde_window or ((0, steps - 1) if p.noise_level > 0 else (steps, steps))
    tail_from = end if start < end else 0
    n = p.num_inference_steps - tail_from
    points = max(int((n + 1) * p.ode_tail_ratio), 2)
    positions = np.linspace(tail_from, p.num_inference_steps, points)
    grid = list(sigmas[:tail_from]) + list(np.interp(positions, np.arange(len(sigmas)), sigmas))
    generator = torch.Generator().manual_seed(p.seed)
    x = adapter.initial_noise(p.height, p.width, generator)[None]
    cond = adapter.encode_prompts([prompt])
    scale = torch.tensor([adapter.cfg_scale(p)])
    lam = lambda s: -math.inf if s >= 1 else math.log((1 - s) / s)  # noqa: E731
    previous = None  # (x0, sigma) of the step before
    for i in range(len(grid) - 1):
        s, s_next = grid[i], grid[i + 1]
        sigma = torch.tensor([s], dtype=torch.float32)
        v = adapter.velocity(x, sigma, cond, [None], scale, p.height, p.width, sigma_values=[float(sigma)]).double()
        x = x.double()
        x0 = x - float(sigma) * v
        if start <= i < end:
            noise = torch.randn(x.shape[1:], generator=generator)[None]
            x = sampler.sde_step(
                x, v, sigma, torch.tensor([s_next]), p.noise_level, noise=noise, sigma_first_step=float(sigmas[1])
            ).next_latents
        elif i >= tail_from and previous is not None and s_next > 0:
            x0_prev, s_prev = previous
            h = lam(s_next) - lam(s)
            r = (lam(s) - lam(s_prev)) / h
            d = x0 + (x0 - x0_prev) / (2 * r)
            x = (s_next / s) * x - (1 - s_next) * (math.exp(-h) - 1) * d
        else:
            x = x + (s_next - s) * v
        previous = (x0, float(sigma))
        x = x.float()
    return x[0]


@pytest.mark.parametrize(
    "flash",
    [FLASH, dict(noise_level=0.0, logprobs=False, ode_solver="dpmpp_2m"), {}],
    ids=["window-and-compressed-tail", "ode-request", "default-sde-euler"],
)
def test_engine_equals_a_plain_multistep_loop(sd3_engine, params, flash):
    p = params.replace(num_inference_steps=8, **flash)
    euler = p.replace(ode_solver="euler", ode_tail_ratio=1.0)
    with FinalLatents(sd3_engine) as final:
        out = final.of(sd3_engine.generate("a photo of a cat", p))
        out_euler = final.of(sd3_engine.generate("a photo of a cat", euler))
    expected = plain_flash_loop(sd3_engine.adapter, "a photo of a cat", p)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)  # float32 against float64 arithmetic
    assert flash == {} or (out_euler - out).abs().max() > 1e-3  # the solver's steps are not Euler's


@pytest.fixture(scope="module")
def toy_engine():
    engine = DiffusionEngine.from_pretrained("flowrl/models/debug/toy_cpu", max_batch_rows=8)
    yield engine
    engine.shutdown()


def test_solver_samples_converge_to_the_fine_euler_ode_faster_than_euler(toy_engine):
    """On the toy world's trained model, against a 384-step Euler ODE of the same sample."""
    ode = SamplingParams(height=48, width=48, noise_level=0.0, logprobs=False, seed=3)
    prompt = "a red circle"
    with FinalLatents(toy_engine) as final:
        fine = final.of(toy_engine.generate(prompt, ode.replace(num_inference_steps=384)))
        error = {
            (solver, n): float(
                (
                    final.of(toy_engine.generate(prompt, ode.replace(num_inference_steps=n, ode_solver=solver))) - fine
                ).norm()
            )
            for solver in ("euler", "dpmpp_2m")
            for n in (8, 16, 32)
        }
    assert error["dpmpp_2m", 8] > error["dpmpp_2m", 16] > error["dpmpp_2m", 32], error
    assert error["dpmpp_2m", 16] < error["euler", 16] and error["dpmpp_2m", 32] < 0.8 * error["euler", 32], error


class ArrivalHook:
    """Wraps adapter.velocity: before forward k, submits the requests scheduled for k from the
    engine thread (a deterministic arrival step)."""

    def __init__(self, engine, arrivals):
        self.engine, self.arrivals, self.futures, self.count = engine, arrivals, [], 0
        self.inner = engine.adapter.velocity

    def __call__(self, latents, *args, **kwargs):
        for prompt, p in self.arrivals.get(self.count, []):
            self.futures.append((prompt, p, self.engine.submit(prompt, p)))
        self.count += 1
        return self.inner(latents, *args, **kwargs)


def _run_with_arrivals(engine, first, arrivals):
    hook = ArrivalHook(engine, arrivals)
    engine.adapter.velocity = hook
    try:
        outputs = [(first[0], first[1], engine.submit(*first).result())]
        while len(hook.futures) < sum(map(len, arrivals.values())):
            engine.wait_until_idle()
        engine.wait_until_idle()
        return outputs + [(prompt, p, f.result()) for prompt, p, f in hook.futures]
    finally:
        del engine.adapter.velocity


def test_a_sample_does_not_depend_on_the_samples_sharing_its_forwards(sd3_engine, params):
    """Samples joining at other steps, with other windows, tails and solvers (CFG included), each
    equal to its solo run."""
    flash = params.replace(num_inference_steps=8, **FLASH)
    arrivals = {
        1: [("a dog", flash.replace(seed=21, sde_window=(3, 5), ode_tail_ratio=0.4))],
        2: [("a red poster with the word hello", params.replace(seed=22, num_inference_steps=8))],
        3: [("open", flash.replace(seed=23, sde_window=None, noise_level=0.0, logprobs=False, ode_tail_ratio=1.0))],
        4: [("a cat", flash.replace(seed=24, guidance_scale=3.0, negative_prompt="blurry"))],
    }
    with FinalLatents(sd3_engine) as final:
        outputs = _run_with_arrivals(sd3_engine, ("a photo of a cat", flash.replace(seed=20)), arrivals)
        assert len(outputs) == 5
        shared = {out.seed: final.of(out) for _, _, out in outputs}
        for prompt, p, out in outputs:
            solo = sd3_engine.generate(prompt, p)
            torch.testing.assert_close(shared[out.seed], final.of(solo), atol=ATOL, rtol=0)
            torch.testing.assert_close(out.all_latents, solo.all_latents, atol=ATOL, rtol=0)
            if p.logprobs:
                torch.testing.assert_close(out.all_log_probs, solo.all_log_probs, atol=ATOL, rtol=0)


def test_window_log_probs_and_trajectory_do_not_depend_on_the_solver(sd3_engine, params):
    flash = params.replace(num_inference_steps=8, **FLASH)
    with FinalLatents(sd3_engine) as final:
        plain = sd3_engine.generate("a photo of a cat", flash.replace(ode_solver="euler", ode_tail_ratio=1.0))
        plain_final = final.of(plain)
        fast = sd3_engine.generate("a photo of a cat", flash)
        fast_final = final.of(fast)
    assert torch.equal(fast.all_log_probs, plain.all_log_probs) and fast.all_log_probs.shape == (2,)
    assert torch.equal(fast.all_latents, plain.all_latents) and torch.equal(fast.sigmas, plain.sigmas)
    assert torch.equal(fast.next_sigmas, plain.next_sigmas) and fast.sde_window == (1, 3)
    assert (fast_final - plain_final).abs().max() > 1e-3


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(ode_solver="heun"), r"ode_solver='heun' is unknown; use one of \('euler', 'dpmpp_2m'\)"),
        (dict(sde_window_size=2, ode_tail_ratio=0.0), r"ode_tail_ratio=0.0 must be in \(0, 1\]"),
        (dict(sde_window_size=2, ode_tail_ratio=1.5), r"ode_tail_ratio=1.5 must be in \(0, 1\]"),
        (dict(sde_window_size=2, ode_tail_ratio=float("nan")), r"ode_tail_ratio=nan must be a finite number"),
        (dict(ode_tail_ratio=0.4), r"ode_tail_ratio=0.4 .*no tail to compress: set sde_window_size"),
        (
            dict(noise_level=0.0, logprobs=False, ode_tail_ratio=0.4),
            r"ode_tail_ratio=0.4 .*use fewer num_inference_steps",
        ),
        (
            dict(ode_solver="dpmpp_2m"),
            r"ode_solver='dpmpp_2m' solves the steps after the SDE window.*set sde_window_size",
        ),
    ],
)
def test_bad_solver_settings_are_refused_naming_the_field_the_value_and_the_fix(params, changes, message):
    with pytest.raises(ValueError, match=r"SamplingParams\." + message):
        params.replace(**changes).validate()
