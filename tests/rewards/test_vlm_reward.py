"""`vlm`: a judge over chat completions, against a stand-in server on 127.0.0.1 (chat_standin.py):
scores and log-probs parsed, failures named with their row and retried only when transient, the
key never shown, concurrency bounded, and the official OpenAI client's request format sent."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from chat_standin import gray_images, standin_server

from flowrl.rewards import RewardError, build_reward
from flowrl.rewards.chat_client import image_data_url
from flowrl.rewards.vlm import VlmReward


@pytest.fixture(scope="module")
def judge():
    with standin_server() as (standin, url):
        yield standin, url


@pytest.fixture
def make(judge):
    """make(**options) -> a VlmReward on the stand-in (closed after the test); sleeps recorded in .sleeps."""
    built = []

    def build(**options):
        sleeps = []
        reward = VlmReward(judge[1], "judge-model", sleep=sleeps.append, **options)
        reward.sleeps = sleeps
        built.append(reward)
        return reward

    yield build
    for reward in built:
        reward.close()


LEVELS = [0, 64, 128, 191, 255]


def test_score_mode_parses_the_scale_normalised_or_raw(make, judge):
    images, prompts, meta = gray_images(LEVELS), [f"p{i}" for i in range(5)], [{}] * 5
    expected_raw = np.array([round(10 * level / 255) for level in LEVELS], dtype=float)
    np.testing.assert_allclose(make()(images, prompts, meta), expected_raw / 10)
    np.testing.assert_allclose(make(normalize=False)(images, prompts, meta), expected_raw)
    np.testing.assert_allclose(make(min_score=-10, max_score=10)(images, prompts, meta), (expected_raw + 10) / 20)
    body = judge[0].bodies[-1]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0 and "logprobs" not in body
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert "from -10 (does not match" in parts[0]["text"] and "p" in parts[0]["text"]


def test_yes_prob_sums_the_case_and_space_variants_of_yes(make, judge):
    images = gray_images(LEVELS)
    scores = make(mode="yes_prob", top_logprobs=5)(images, ["a"] * 5, [{}] * 5)
    np.testing.assert_allclose(scores, np.clip(np.array(LEVELS) / 255, 1e-6, 1 - 1e-6), atol=1e-9)
    body = judge[0].bodies[-1]
    assert body["logprobs"] is True and body["top_logprobs"] == 5 and body["max_tokens"] == 1
    # Only the first variant returned: the stand-in's top-1 is "Yes" at 0.7 p.
    np.testing.assert_allclose(make(mode="yes_prob", top_logprobs=1)(images[4:], ["a"], [{}]), [0.7 * (1 - 1e-6)])


def test_templates_quote_ground_truth_and_bad_templates_are_named(make, judge, tmp_path):
    template = tmp_path / "ask.txt"
    template.write_text(
        "Does it read {ground_truth!r}? Prompt: {prompt}. {{literal}} Answer from {min_score} to {max_score}."
    )
    reward = make(template=str(template))
    reward(gray_images([255]), ["a sign"], [{"ground_truth": "OPEN"}])
    text = judge[0].bodies[-1]["messages"][0]["content"][0]["text"]
    assert text == "Does it read 'OPEN'? Prompt: a sign. {literal} Answer from 0 to 10."
    assert "ground_truth" in reward.cannot_score({})
    with pytest.raises(RewardError, match="row 0.*ground_truth"):
        reward(gray_images([255]), ["a sign"], [{}])
    template.write_text("Is it {colour}?")
    with pytest.raises(ValueError, match=r"placeholder\(s\) \['colour'\]"):
        make(template=str(template))
    with pytest.raises(ValueError, match="template='/no/such.txt'"):
        make(template="/no/such.txt")


@pytest.mark.parametrize(
    "marker, kind, num_attempts",
    [
        ("[400]", "http status", 1),
        ("[garbage]", "unparsable", 1),
        ("[notjson]", "unparsable", 1),
        ("[429x9]", "rate limited", 3),
        ("[500x9]", "server error", 3),
    ],
)
def test_a_failed_row_is_a_reward_error_naming_row_prompt_and_failure(make, marker, kind, num_attempts):
    reward = make(max_attempts=3, backoff_s=0.25, max_backoff_s=0.5)
    prompts = ["fine", f"bad {marker}", "fine too"]
    with pytest.raises(RewardError) as caught:
        reward(gray_images([10, 20, 30]), prompts, [{}] * 3)
    message = str(caught.value)
    assert caught.value.row_index == 1 and f"judge {kind} after {num_attempts} attempt" in message
    assert repr(prompts[1]) in message
    assert reward.sleeps == [0.25, 0.5][: num_attempts - 1]  # backoff doubles, capped
    scores, failures = reward.score_or_nan(gray_images([10, 20, 30]), prompts, [{}] * 3)  # never a silent 0
    assert np.isnan(scores[1]) and np.isfinite(scores[[0, 2]]).all() and [f.row_index for f in failures] == [1]


def test_transient_failures_are_retried_until_they_pass(make):
    reward = make(backoff_s=0.1)
    scores = reward(gray_images([255, 255]), ["a [429x2]", "b [500x1]"], [{}, {}])
    np.testing.assert_allclose(scores, [1.0, 1.0])
    assert sorted(reward.sleeps) == [0.1, 0.1, 0.2]


def test_unreachable_and_slow_judges_are_named():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reward = VlmReward(f"http://127.0.0.1:{port}/v1", "m", max_attempts=2, sleep=lambda s: None)
    with pytest.raises(RewardError, match=r"row 0: judge unreachable after 2 attempts.*ConnectError"):
        reward(gray_images([1]), ["x"], [{}])
    reward.close()


def test_slow_answer_times_out(judge):
    reward = VlmReward(judge[1], "m", timeout_s=0.3, max_attempts=1)
    with pytest.raises(RewardError, match="row 0: judge timed out after 1 attempt"):
        reward(gray_images([1]), ["x [slow]"], [{}])
    reward.close()


def test_optional_component_turns_only_the_failed_row_into_nan(judge):
    multi = build_reward(
        {
            "name": "multi",
            "options": {
                "components": [
                    {"name": "vlm", "optional": True, "options": {"url": judge[1], "model": "m", "max_attempts": 1}},
                    {"name": "image_flatness"},
                ]
            },
        }
    )
    total, components = multi.score_with_components(gray_images([255] * 3), ["a", "b [400]", "c"], [{}] * 3)
    assert np.isnan(total[1]) and np.isfinite(total[[0, 2]]).all()
    np.testing.assert_allclose(components["vlm"][[0, 2]], [1.0, 1.0])


def test_api_key_from_the_named_variable_is_sent_and_never_shown(judge, monkeypatch):
    secret = "sk-test-SECRET-123"
    monkeypatch.setenv("JUDGE_KEY", secret)
    reward = VlmReward(judge[1], "m", api_key_env="JUDGE_KEY", max_attempts=1)
    reward(gray_images([3]), ["x"], [{}])
    assert judge[0].headers[-1]["authorization"] == f"Bearer {secret}"
    with pytest.raises(RewardError) as caught:
        reward(gray_images([3]), ["x [400]"], [{}])
    assert secret not in str(caught.value) and secret not in repr(vars(reward))
    reward.close()
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ValueError, match="api_key_env='JUDGE_KEY'.*JUDGE_KEY is not set"):
        VlmReward(judge[1], "m", api_key_env="JUDGE_KEY")


def test_concurrency_is_bounded_and_used():
    with standin_server(delay_s=0.1) as (standin, url):
        reward = VlmReward(url, "m", max_concurrency=4)
        started = time.perf_counter()
        reward(gray_images([9] * 8), ["x"] * 8, [{}] * 8)
        elapsed = time.perf_counter() - started
        reward.close()
    assert standin.max_in_flight == 4
    assert elapsed < 0.6  # 8 rows x 0.1 s one by one would take 0.8 s; 4 at a time, two rounds


def test_options_are_checked_with_the_fix(judge):
    for options, match in [
        ({"url": "127.0.0.1:8000", "model": "m"}, "url='127.0.0.1:8000' must start with http"),
        ({"url": judge[1], "model": "m", "mode": "likert"}, "mode='likert' must be one of score, yes_prob, pairwise"),
        ({"url": judge[1], "model": "m", "max_concurrency": 0}, "max_concurrency=0 must be an integer >= 1"),
        ({"url": judge[1], "model": "m", "min_score": 5, "max_score": 5}, "max_score must be larger"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_reward({"name": "vlm", "options": options})


def test_requests_equal_the_official_openai_clients(judge):
    """The official client, given the documented vision message, sends the body flowrl sends."""
    openai = pytest.importorskip("openai")
    image = gray_images([77])[0]
    reward = VlmReward(judge[1], "judge-model", mode="yes_prob", top_logprobs=4)
    reward(image[None], ["a red cube"], [{}])
    ours = judge[0].bodies[-1]
    client = openai.OpenAI(base_url=judge[1], api_key="unused", max_retries=0)
    client.chat.completions.create(
        model="judge-model",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": reward.question("a red cube", {})},
                    {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                ],
            }
        ],
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=4,
    )
    client.close()
    reward.close()
    assert judge[0].bodies[-1] == ours
