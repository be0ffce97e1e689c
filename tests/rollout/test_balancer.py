"""LeastInFlightBalancer: least-in-flight choice, and failover: a replica that goes down has its
unfinished requests re-sent to another (the caller never sees it), is dropped after
max_failures in a row with a warning, and with none left every request fails clearly; errors of
the request itself are passed on, never failed over."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import pytest

from flowrl.rollout.balancer import LeastInFlightBalancer, NoReplicaLeftError, ReplicaDownError
from flowrl.sampling_params import SamplingParams


class FakeReplica:
    """Answers sample j of a request with (name, prompt, seed + j) on a thread; `fail_after`:
    samples of index >= fail_after fail with `error` (None: never fail)."""

    supports_batched_generation = True

    def __init__(self, name: str, error: BaseException | None = None, fail_after: int = 0, gate=None):
        self.url = f"http://127.0.0.1/{name}"
        self.name, self.error, self.fail_after, self.gate = name, error, fail_after, gate
        self.calls: list[tuple[str, int]] = []

    def submit(self, prompt, params):
        return self.submit_batched(prompt, 1, params)[0]

    def submit_batched(self, prompt, n, params):
        self.calls.append((prompt, n))
        return self._answer([prompt] * n, params)

    def submit_many(self, prompts, params, n=1):
        self.calls.append((tuple(prompts), n))
        return self._answer([p for p in prompts for _ in range(n)], params)

    def _answer(self, prompts, params):
        futures = [Future() for _ in prompts]

        def run():
            if self.gate is not None:
                self.gate.wait(10)
            for j, (prompt, f) in enumerate(zip(prompts, futures)):
                if self.error is not None and j >= self.fail_after:
                    f.set_exception(self.error)
                else:
                    f.set_result((self.name, prompt, params.seed + j))

        threading.Thread(target=run, daemon=True).start()
        return futures


def submit_groups(balancer, num_groups=4, n=3, gate=None):
    futures = {}
    for g in range(num_groups):
        futures[g] = balancer.submit_batched(f"p{g}", n, SamplingParams(seed=100 * g))
    if gate is not None:
        gate.set()
    return {g: [f.result(timeout=10) for f in fs] for g, fs in futures.items()}


def test_least_in_flight_keeps_a_group_on_one_replica():
    gate = threading.Event()
    a, b = FakeReplica("a", gate=gate), FakeReplica("b", gate=gate)
    balancer = LeastInFlightBalancer([a, b])
    results = submit_groups(balancer, num_groups=2, gate=gate)
    assert {r[0][0] for r in results.values()} == {"a", "b"}
    assert all(len({name for name, _, _ in r}) == 1 for r in results.values())
    assert balancer.assigned == [3, 3] and balancer.in_flight == [0, 0]


def test_requests_of_a_replica_that_goes_down_are_resent(caplog):
    dead = FakeReplica("dead", ReplicaDownError("connection refused"))
    alive = FakeReplica("alive")
    balancer = LeastInFlightBalancer([dead, alive], max_failures=2)
    with caplog.at_level(logging.WARNING, logger="flowrl.rollout.balancer"):
        results = submit_groups(balancer)
    for g, samples in results.items():
        assert samples == [("alive", f"p{g}", 100 * g + j) for j in range(3)]  # every sample, once, in order
    assert balancer.is_dropped == [True, False] and balancer.num_resent >= 1
    assert any("dropped" in r.message and "dead" in r.message for r in caplog.records)
    # Once dropped, it gets nothing more.
    calls = len(dead.calls)
    submit_groups(balancer, num_groups=2)
    assert len(dead.calls) == calls


def test_a_group_that_half_finished_is_completed_from_the_resend():
    flaky = FakeReplica("flaky", ReplicaDownError("died mid-rollout"), fail_after=1)
    alive = FakeReplica("alive")
    balancer = LeastInFlightBalancer([flaky, alive], max_failures=1)
    samples = [f.result(timeout=10) for f in balancer.submit_batched("p", 3, SamplingParams(seed=7))]
    assert [s[2] for s in samples] == [7, 8, 9]
    assert samples[0][0] == "flaky" and {s[0] for s in samples[1:]} == {"alive"}
    assert alive.calls == [("p", 3)]  # the whole group re-sent as one request


@pytest.mark.parametrize("n", [1, 2])
def test_a_list_of_prompts_goes_to_one_replica_as_one_call_and_is_resent_whole(n):
    flaky = FakeReplica("flaky", ReplicaDownError("died mid-rollout"), fail_after=2)
    alive = FakeReplica("alive")
    balancer = LeastInFlightBalancer([flaky, alive], max_failures=1)
    assert balancer.supports_submit_many
    prompts = ["p0", "p1", "p2", "p3"][: 4 // n]
    samples = [f.result(timeout=10) for f in balancer.submit_many(prompts, SamplingParams(seed=20), n)]
    assert [(prompt, seed) for _, prompt, seed in samples] == [
        (p, 20 + i * n + j) for i, p in enumerate(prompts) for j in range(n)
    ]
    assert [s[0] for s in samples] == ["flaky", "flaky", "alive", "alive"]
    assert flaky.calls == alive.calls == [(tuple(prompts), n)]  # one call each: the list stays together
    assert balancer.in_flight == [0, 0]


def test_no_replica_left_fails_every_request_naming_each():
    a = FakeReplica("a", ReplicaDownError("refused A"))
    b = FakeReplica("b", ReplicaDownError("refused B"))
    balancer = LeastInFlightBalancer([a, b], max_failures=1)
    futures = balancer.submit_batched("p", 2, SamplingParams(seed=1))
    for f in futures:
        with pytest.raises(NoReplicaLeftError, match="refused A.*refused B"):
            f.result(timeout=10)
    with pytest.raises(NoReplicaLeftError, match="every rollout replica was dropped"):
        balancer.submit("q", SamplingParams(seed=2))[0].result(timeout=10)


def test_request_errors_are_not_failed_over():
    class Refusing(FakeReplica):
        def submit_batched(self, prompt, n, params):
            raise ValueError("SamplingParams.height=100 is not a multiple of 16")

    balancer = LeastInFlightBalancer([Refusing("r"), FakeReplica("ok")])
    with pytest.raises(ValueError, match="multiple of 16"):
        balancer.submit_batched("p", 2, SamplingParams(seed=1))
    # A request that fails on the replica (not a replica failure) fails as it is, nothing dropped.
    failing = FakeReplica("bad", RuntimeError("the step failed"))
    balancer = LeastInFlightBalancer([failing, FakeReplica("ok")])
    with pytest.raises(RuntimeError, match="the step failed"):
        balancer.submit("p", SamplingParams(seed=1))[0].result(timeout=10)
    assert balancer.is_dropped == [False, False] and balancer.num_resent == 0


def test_bad_max_failures():
    with pytest.raises(ValueError, match="max_failures"):
        LeastInFlightBalancer([FakeReplica("a")], max_failures=0)
