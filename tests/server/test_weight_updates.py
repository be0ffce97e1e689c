"""Weight updates of `flowrl serve`: guarded by the admin token; a LoRA or full weights with a wrong
checksum, name, shape or dtype, or meant for another module of the checkpoint, is refused with a
4xx while the old weights keep serving; a good update makes the server sample exactly as an in-process engine with those weights, and every
output carries the policy version of the weights that produced it, also across an update made
while requests are in flight."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from rollout_server_helpers import ADMIN, SAMPLING, serving

from flowrl.config.sections import LoraConfig
from flowrl.engine import DiffusionEngine
from flowrl.models.lora import apply_trainable, trainable_state_dict
from flowrl.server import wire

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "dropout": 0.0}
PARAMS = SAMPLING.replace(seed=21)


def _random_lora(engine: DiffusionEngine, seed: int) -> dict[str, torch.Tensor]:
    """Give the engine's transformer the LoRA (random weights of `seed`); return its state."""
    from flowrl.models.lora import has_lora

    transformer = engine.adapter.transformer
    if not has_lora(transformer):
        apply_trainable(transformer, LoraConfig(enabled=True, init="default", **LORA))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_state_dict(transformer).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return {name: t.clone() for name, t in trainable_state_dict(transformer).items()}


def _push(client: httpx.Client, body: bytes, kind: str = "lora", version: int = 1, sha256: str | None = None, **kw):
    query = {"kind": kind, "version": str(version), "sha256": sha256 or wire.file_sha256(body)}
    headers = kw.pop("headers", ADMIN)
    return client.post(wire.WEIGHTS_PATH, params=query, content=body, headers=headers, **kw)


def _sample(client: httpx.Client, params=PARAMS, prompt: str = "a green ball"):
    response = client.post(wire.ROLLOUTS_PATH, json=wire.rollout_request(prompt, 2, params))
    assert response.status_code == 200, response.text
    return wire.decode_outputs(response.content)


def _close(outputs, reference, atol: float = 1e-5) -> bool:
    return all(torch.allclose(a.all_latents, b.all_latents, atol=atol, rtol=0) for a, b in zip(outputs, reference))


@pytest.fixture(scope="module")
def reference(tiny_sd3_path):
    """An in-process engine that takes the weights the tests push, to compute what the server must return."""
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_rows=32)
    yield engine
    engine.shutdown()


def test_admin_endpoints_need_the_token(tiny_sd3_path):
    body = wire.encode_weights({"x": torch.zeros(1)})
    with serving(tiny_sd3_path, admin_token=None) as off, off.client() as client:
        for response in (_push(client, body), client.post(wire.PAUSE_PATH, headers=ADMIN)):
            assert response.status_code == 403 and "--admin-token" in response.json()["error"]["message"]
    with serving(tiny_sd3_path) as server, server.client() as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "token"}):
            for response in (
                _push(client, body, headers=headers),
                client.get(wire.WEIGHTS_PATH, headers=headers),
                client.post(wire.RESUME_PATH, headers=headers),
            ):
                assert response.status_code == 401 and "admin token" in response.json()["error"]["message"]
        assert server.engine.policy_version == 0


def test_bad_updates_are_refused_and_the_old_weights_keep_serving(tiny_sd3_path, reference):
    state = _random_lora(reference, seed=1)
    good = wire.encode_weights(state, lora=LORA)
    first = next(iter(sorted(state)))
    wrong_shape = {**state, first: torch.zeros(state[first].shape[0] + 1, state[first].shape[1])}
    other_rank = {**LORA, "rank": 2}
    cases = {
        "not safetensors": (dict(body=b"not a safetensors file"), 400, "not a safetensors file"),
        "bad kind": (dict(body=good, kind="adapter"), 400, "kind="),
        "bad version": (dict(body=good, version=-1), 400, "version="),
        "bad checksum": (dict(body=good, sha256="0" * 64), 422, "sha256 mismatch"),
        "short checksum": (dict(body=good, sha256="abc"), 400, "64 hex digits"),
        "no LoRA settings": (dict(body=wire.encode_weights(state)), 409, "no LoRA settings"),
        "wrong shape": (dict(body=wire.encode_weights(wrong_shape, lora=LORA)), 422, first),
        "wrong rank": (dict(body=wire.encode_weights(state, lora=other_rank)), 422, "is torch.float32"),
        "missing tensor": (dict(body=wire.encode_weights(dict(list(state.items())[1:]), lora=LORA)), 422, "1 missing"),
        "extra tensor": (
            dict(body=wire.encode_weights({**state, "x.weight": torch.zeros(1)}, lora=LORA)),
            422,
            "1 unexpected",
        ),
        "wrong dtype": (
            dict(body=wire.encode_weights({**state, first: state[first].bfloat16()}, lora=LORA)),
            422,
            "bfloat16",
        ),
        "full over nothing wrong": (dict(body=good, kind="full"), 422, "do not match"),
        "non-finite": (
            dict(
                body=wire.encode_weights(
                    {**state, first: state[first].index_fill(0, torch.tensor([0]), float("nan"))}, lora=LORA
                )
            ),
            422,
            "non-finite value(s)",
        ),
        "oversized": (dict(body=b"\0" * (2**20 + 1)), 413, "--max-weights-mb"),
        # Wan2.2-A14B's low expert's weights: the same names and shapes as the module served here.
        "another module's": (
            dict(body=wire.encode_weights(state, lora=LORA, component="transformer_2")),
            409,
            "start the server with model.trained_expert=low",
        ),
    }
    with serving(tiny_sd3_path) as server, server.client() as client:
        before = _sample(client)
        for name, (arguments, status, fragment) in cases.items():
            response = _push(client, **arguments)
            assert response.status_code == status, (name, response.text)
            assert fragment in response.json()["error"]["message"], (name, response.text)
            after = _sample(client)
            assert _close(after, before, atol=0) and {o.policy_version for o in after} == {0}, name
        assert server.engine.policy_version == 0
        # The same weights, pushed right, go live.
        response = _push(client, good, version=3)
        assert response.status_code == 200, response.text
        assert response.json()["policy_version"] == 3 and response.json()["weights_sha256"] == wire.weights_sha256(
            state
        )
        # Now the server holds a LoRA: full weights cannot replace it, other LoRA settings are refused.
        full = wire.encode_weights(dict(server.engine.adapter.transformer.named_parameters()))
        assert _push(client, full, kind="full", version=4).status_code == 409
        mismatch = _push(client, wire.encode_weights(state, lora={**LORA, "alpha": 1.0}), version=4)
        assert mismatch.status_code == 422 and "differ from the served" in mismatch.json()["error"]["message"]
        assert server.engine.policy_version == 3


def test_a_lora_update_samples_as_the_in_process_engine_with_it(tiny_sd3_path, reference):
    state = _random_lora(reference, seed=2)
    with serving(tiny_sd3_path) as server, server.client() as client:
        base = _sample(client)
        response = _push(client, wire.encode_weights(state, lora=LORA), version=7)
        assert response.status_code == 200, response.text
        updated = _sample(client)
        assert {o.policy_version for o in updated} == {7}
        assert not _close(updated, base, atol=1e-3)  # the LoRA changes what is sampled
        assert _close(updated, reference.generate_batched("a green ball", 2, PARAMS))
        info = client.get(wire.WEIGHTS_PATH, headers=ADMIN).json()
        assert info == {
            "policy_version": 7,
            "kind": "lora",
            "weights_sha256": wire.weights_sha256(state),
            "num_tensors": len(state),
        }


def test_full_weights_update(tiny_sd3_path, reference):
    generator = torch.Generator().manual_seed(3)
    with serving(tiny_sd3_path) as server, server.client() as client:
        live = dict(server.engine.adapter.transformer.named_parameters())
        state = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator) for name, p in live.items()}
        response = _push(client, wire.encode_weights(state), kind="full", version=1)
        assert response.status_code == 200, response.text
        assert response.json()["kind"] == "full" and response.json()["weights_sha256"] == wire.weights_sha256(state)
        local = DiffusionEngine.from_pretrained(tiny_sd3_path)
        try:
            with torch.no_grad():
                for name, p in local.adapter.transformer.named_parameters():
                    p.copy_(state[name])
            assert _close(_sample(client), local.generate_batched("a green ball", 2, PARAMS.replace(seed=21)))
        finally:
            local.shutdown()


def test_outputs_carry_the_version_of_the_weights_that_produced_them(tiny_sd3_path, reference):
    """An update pushed while requests are in flight: it waits for them, and every output equals
    the in-process sample of the weights its policy_version names."""
    states = {1: _random_lora(reference, seed=4), 2: _random_lora(reference, seed=5)}
    slow = SAMPLING.replace(num_inference_steps=16)
    seeds = list(range(100, 116, 2))
    expected = {}
    for version, state in states.items():
        _load(reference, state)
        futures = {s: reference.submit_batched("a green ball", 2, slow.replace(seed=s)) for s in seeds}
        expected[version] = {s: [f.result() for f in fs] for s, fs in futures.items()}
    assert not _close(expected[1][seeds[0]], expected[2][seeds[0]], atol=1e-3)
    with serving(tiny_sd3_path) as server, server.client() as client:
        assert _push(client, wire.encode_weights(states[1], lora=LORA), version=1).status_code == 200
        answers, threads = {}, []

        def send(seed: int) -> None:
            with server.client() as own:
                answers[seed] = _sample(own, slow.replace(seed=seed))

        admission = server.app.state.service.admission
        for i, seed in enumerate(seeds):
            threads.append(threading.Thread(target=send, args=(seed,)))
            threads[-1].start()
            if i == len(seeds) // 2:  # half sent: push the second version while they run
                deadline = time.monotonic() + 30
                while admission.num_in_flight == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert admission.num_in_flight > 0
                assert _push(client, wire.encode_weights(states[2], lora=LORA), version=2).status_code == 200
        for thread in threads:
            thread.join(timeout=120)
    versions = {seed: {o.policy_version for o in outputs} for seed, outputs in answers.items()}
    assert len(answers) == len(seeds) and all(len(v) == 1 for v in versions.values())
    assert {v for vs in versions.values() for v in vs} == {1, 2}
    for seed, outputs in answers.items():
        assert _close(outputs, expected[outputs[0].policy_version][seed]), (seed, versions[seed])


def _load(engine: DiffusionEngine, state: dict[str, torch.Tensor]) -> None:
    params = dict(engine.adapter.transformer.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
