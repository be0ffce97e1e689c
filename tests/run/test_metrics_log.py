"""metrics.jsonl and tensorboard across crashes and resumes: a torn last line is dropped with a
warning naming file and line, a damaged line elsewhere is an error naming them, and a resumed run
shows every step once in metrics.jsonl and in the tensorboard event files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flowrl.run.metrics import MetricsLogger, read_metrics


def _write(path: Path, steps, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps) + tail)


def test_torn_last_line_is_dropped_with_a_warning(tmp_path, capfd):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3], tail='{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    err = capfd.readouterr().err
    assert f"{path} line 4" in err and "dropped" in err


def test_resume_keeps_steps_up_to_the_checkpoint_and_repairs_a_torn_line(tmp_path, capfd):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3, 4, 5], tail='{"step": 6')
    logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    assert "line 6" in capfd.readouterr().err
    logger.log(4, {"loss": 0.5})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert capfd.readouterr().err == ""  # the file is whole again


def test_damaged_line_before_the_end_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path} line 2 is damaged"):
        read_metrics(path)
    with pytest.raises(ValueError, match="line 2"):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=2)


def _tensorboard_points(tb_dir: Path) -> Counter:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    points = Counter()
    for path in tb_dir.rglob("events.out.tfevents.*"):
        for raw in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(raw)
            for value in event.summary.value:
                points[(value.tag, event.step)] += 1
    return points


def test_resume_leaves_no_duplicate_tensorboard_points(tmp_path):
    first = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):  # crashed after step 5; the last checkpoint was at step 3
        first.log(step, {"loss": float(step)})
    first.close()
    second = MetricsLogger(tmp_path, tensorboard=True, resume_step=3)
    for step in range(4, 8):
        second.log(step, {"loss": float(step) + 0.5})
    second.close()
    points = _tensorboard_points(tmp_path / "tensorboard")
    assert sorted(step for _, step in points) == list(range(1, 8))
    assert set(points.values()) == {1}
