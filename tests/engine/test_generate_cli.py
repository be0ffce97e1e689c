"""`flowrl generate` runs end to end in-process and reports that batching happened."""

from __future__ import annotations

import json

from PIL import Image

from flowrl.cli import main


def test_generate_cli_writes_pngs_and_stats(tiny_qwen_path, tmp_path, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_qwen_path),
            "--prompt",
            "a cat",
            "--prompt",
            "a red sign",
            "-n",
            "3",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 6 and Image.open(pngs[0]).size == (64, 64)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["num_samples_finished"] == 6
    assert max(int(k) for k in stats["rows_per_forward_hist"]) > 1
    assert "mean rows/forward" in capsys.readouterr().out
