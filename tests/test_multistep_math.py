"""MixGRPO-Flash's ODE tail math (flowrl.sampler): DPM-Solver++(2M) against the paper's formula
and an exact ODE solution, and the tail compression against MixGRPO's own rule."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl import sampler

# Data x0 ~ N(MU, SD^2) per element: the rectified flow's exact velocity and ODE solution are known.
MU, SD = 0.8, 0.3


def _variance(s):
    return (1 - s) ** 2 * SD**2 + s**2


def gaussian_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """E[noise - x0 | x_sigma] for Gaussian data, per row sigma (B,)."""
    s = sigma.view(-1, 1).double()
    d = x.double() - (1 - s) * MU
    var = _variance(s)
    return (s / var * d - (MU + (1 - s) * SD**2 / var * d)).float()


def shifted_grid(steps: int, shift: float = 3.0) -> list[float]:
    """SD3-style sigmas: a shift of linspace(1, 0, steps + 1) (MixGRPO's FLUX schedule)."""
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).tolist()


def solve(x: torch.Tensor, sigmas: list[float], solver: str) -> torch.Tensor:
    """The engine's per-step rule: Euler where there is no previous prediction or at sigma 0."""
    rows = x.shape[0]
    x0_prev = sigma_prev = None
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        sig, sig_next = torch.full((rows,), s), torch.full((rows,), s_next)
        v = gaussian_velocity(x, sig)
        x0 = sampler.data_prediction(x, v, sig)
        if solver == "dpmpp_2m" and x0_prev is not None and s_next > 0:
            coefficients = torch.tensor(sampler.dpmpp_2m_coefficients(sigma_prev, s, s_next)).view(3, 1).expand(3, rows)
            x = sampler.multistep_update(x, x0, x0_prev, coefficients)
        else:
            x = sampler.ode_step(x, v, sig, sig_next)
        x0_prev, sigma_prev = x0, s
    return x


def test_dpmpp_2m_converges_to_the_exact_ode_solution_faster_than_euler():
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    exact = MU + SD * noise.double()  # the ODE from sigma 1 keeps each sample's standardized position
    steps = (32, 64, 128, 256, 512)
    errors = {
        solver: [float((solve(noise, shifted_grid(n), solver).double() - exact).abs().max()) for n in steps]
        for solver in ("euler", "dpmpp_2m")
    }
    euler, dpm = errors["euler"], errors["dpmpp_2m"]
    assert all(d < e for d, e in zip(dpm, euler)), errors
    # Euler is first order: doubling the steps halves its error.
    assert all(1.8 < a / b < 2.2 for a, b in zip(euler, euler[1:])), errors
    # DPM-Solver++(2M) is second order (its error changes sign on the way, so the slope is read
    # over the whole range: 16x the steps divide it by more than twice what they divide Euler's by).
    assert dpm[0] / dpm[-1] > 2 * euler[0] / euler[-1] and dpm[-1] < euler[-1] / 5, errors


def _paper_step(x, x0, x0_prev, s_prev, s, s_next):
    """DPM-Solver++(2M) as written in arXiv 2211.01095 (multistep, second order), alpha = 1 - sigma."""
    lam = lambda sig: math.log((1 - sig) / sig)  # noqa: E731
    h = lam(s_next) - lam(s)
    r = (lam(s) - lam(s_prev)) / h
    d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
    return (s_next / s) * x - (1 - s_next) * (math.exp(-h) - 1) * d


@pytest.mark.parametrize("sigmas", [(0.9, 0.7, 0.5), (0.5, 0.45, 0.1), (0.2, 0.05, 0.01)])
def test_coefficients_are_the_papers_update(sigmas):
    x, x0, x0_prev = (torch.randn(2, 5, generator=torch.Generator().manual_seed(i)).double() for i in range(3))
    coefficients = torch.tensor(sampler.dpmpp_2m_coefficients(*sigmas)).view(3, 1).expand(3, 2)
    got = sampler.multistep_update(x, x0, x0_prev, coefficients)
    torch.testing.assert_close(got.double(), _paper_step(x, x0, x0_prev, *sigmas), atol=1e-6, rtol=0)


def test_first_order_update_is_the_euler_step():
    # From sigma_prev = 1 the correction vanishes: DPM-Solver++'s first-order step, Euler's on a rectified flow.
    x, v = torch.randn(3, 6, generator=torch.Generator().manual_seed(4)), torch.randn(3, 6)
    s, s_next = torch.full((3,), 0.8), torch.full((3,), 0.6)
    c = sampler.dpmpp_2m_coefficients(1.0, 0.8, 0.6)
    assert c[2] == 0.0
    got = sampler.multistep_update(
        x, sampler.data_prediction(x, v, s), torch.zeros_like(x), torch.tensor(c).view(3, 1).expand(3, 3)
    )
    torch.testing.assert_close(got, sampler.ode_step(x, v, s, s_next), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="sigma_next < sigma < sigma_prev"):
        sampler.dpmpp_2m_coefficients(0.5, 0.6, 0.3)


def _mixgrpo_tail(steps: int, last_sde: int, ratio: float, shift: float = 3.0) -> list[float]:
    """MixGRPO's rebuilt schedule (fastvideo/utils/sampling_utils.py, dpm_apply_strategy post):
    the schedule up to the window's last step, then int(max((T - last) * ratio, 1)) points evenly
    spaced in unshifted time from the next step's time to 0, shifted."""
    points = int(max((steps - last_sde) * ratio, 1))
    t_next = torch.linspace(1, 0, steps + 1, dtype=torch.float64)[last_sde + 1].item()
    post = torch.linspace(t_next, 0, points, dtype=torch.float64)
    return shifted_grid(steps, shift)[: last_sde + 1] + (shift * post / (1 + (shift - 1) * post)).tolist()


@pytest.mark.parametrize("ratio", [0.4, 0.2])
def test_compressed_tail_follows_mixgrpo(ratio):
    steps, sigmas = 25, shifted_grid(25)
    for end in range(1, 24):  # windows [end - 4, end) as MixGRPO's progressive schedule moves them
        ours = sampler.compress_tail(sigmas, end, ratio)
        reference = _mixgrpo_tail(steps, end - 1, ratio)
        assert ours[: end + 1] == sigmas[: end + 1] and ours[-1] == 0.0
        assert all(a > b for a, b in zip(ours, ours[1:]))
        if len(reference) >= end + 2:  # MixGRPO keeps at least one tail step only from 2 points on
            assert len(ours) == len(reference)
            # Equal where its points fall on the schedule's; linear between them otherwise.
            tail = (steps - end) / (len(ours) - end - 1)
            atol = 1e-9 if tail == int(tail) else 2e-3
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), atol=atol, rtol=0)
        else:
            assert len(ours) == end + 2  # one step to sigma 0 where MixGRPO stops short of it
    assert sampler.compress_tail(sigmas, 4, 1.0) == sigmas
    assert len(sampler.compress_tail(sigmas, 4, 0.4)) - 1 == 4 + 7  # MixGRPO-Flash: 21 tail steps -> 7
