"""`vlm` wherever a reward goes: `flowrl reward-score`, `flowrl eval` (pairwise, each prompt's
samples one group), and `flowrl reward-server` with the http reward (a group-wise reward's
requests cut between groups). The judge is the stand-in of chat_standin.py on 127.0.0.1."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_standin import gray_images, standin_server
from PIL import Image

from flowrl.cli import main
from flowrl.rewards.http_client import HttpReward
from flowrl.rewards.vlm import VlmReward
from flowrl.server.http import serve_in_background
from flowrl.server.reward_app import create_reward_app


@pytest.fixture(scope="module")
def judge():
    with standin_server() as (standin, url):
        yield standin, url


def test_reward_score_prints_the_judges_scores(judge, tmp_path, capsys):
    files = []
    for level in (0, 255):
        files.append(str(tmp_path / f"{level}.png"))
        Image.new("RGB", (8, 8), (level,) * 3).save(files[-1])
    options = ["--option", f"url={judge[1]}", "--option", "model=m"]
    assert main(["reward-score", "--reward", "vlm", *options, "--prompt", "a gray square", *files]) == 0
    assert [float(line.split()[-1]) for line in capsys.readouterr().out.split("\n") if line.strip()] == [0.0, 1.0]
    assert main(["reward-score", "--reward", "vlm", *options, "--prompt", "x [400]", *files]) == 1
    err = capsys.readouterr().err
    assert "row 0" in err and "judge http status" in err


def test_eval_scores_each_prompts_samples_as_one_pairwise_group(judge, tiny_sd3_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    before = len(judge[0].bodies)
    argv = ["eval", "--model", str(tiny_sd3_path), "--prompts", str(prompts), "-n", "3", "--reward", "vlm"]
    argv += ["--option", f"vlm.url={judge[1]}", "--option", "vlm.model=m", "--option", "vlm.mode=pairwise"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval_report.json").read_text())
    stats = report["evaluations"][0]["scores"]["vlm"]
    assert len(judge[0].bodies) - before == 2 * 3  # two groups of three: three pairs each
    assert stats["mean"] == pytest.approx(0.5)  # win rates within a group average one half


def test_reward_server_serves_the_judge(judge):
    local = VlmReward(judge[1], "m")
    images, prompts = gray_images([0, 100, 255]), ["a", "b", "c"]
    with serve_in_background(create_reward_app(local)) as url:
        np.testing.assert_array_equal(HttpReward(url)(images, prompts, [{}] * 3), local(images, prompts, [{}] * 3))
    local.close()


def test_a_remote_pairwise_reward_gets_whole_groups_per_request(judge):
    local = VlmReward(judge[1], "m", mode="pairwise")
    images, meta = gray_images([5, 50, 10, 200, 30, 90, 100, 1, 255]), [{"uid": f"g{row // 3}"} for row in range(9)]
    with serve_in_background(create_reward_app(local)) as url:
        remote = HttpReward(url, scores_groups=True, max_request_images=5)
        assert remote.scores_groups
        assert remote._request_slices([b"x"] * 9, [m["uid"] for m in meta]) == [slice(0, 3), slice(3, 6), slice(6, 9)]
        np.testing.assert_array_equal(remote(images, ["p"] * 9, meta), local(images, ["p"] * 9, meta))
    local.close()
