"""Every command that writes refuses what flowrl did not write (flowrl.output_paths): one line naming
the path and --overwrite, exit 2, nothing touched; flowrl's own marked folders are rewritten freely."""

from __future__ import annotations

import pytest

from flowrl.cli import main
from flowrl.output_paths import OutputExistsError, check_output_folder, read_marker, write_marker


def _one_error_line(capsys, path) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(path) in err[0] and "--overwrite" in err[0], err
    return err[0]


def test_folder_rule(tmp_path):
    check_output_folder(tmp_path / "new", "x", overwrite=False)  # missing: fine
    (tmp_path / "empty").mkdir()
    check_output_folder(tmp_path / "empty", "x", overwrite=False)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "weights.bin").write_bytes(b"1")
    with pytest.raises(OutputExistsError, match=r"used is not empty \(weights.bin\).*\.flowrl-x.*--overwrite"):
        check_output_folder(tmp_path / "used", "x", overwrite=False)
    check_output_folder(tmp_path / "used", "x", overwrite=True)
    write_marker(tmp_path / "used", "x", ["weights.bin"], kind="demo")
    check_output_folder(tmp_path / "used", "x", overwrite=False)  # marked: flowrl's own
    assert read_marker(tmp_path / "used", "x") == {"kind": "demo", "files": ["weights.bin"]}
    with pytest.raises(OutputExistsError):  # another command's marker does not count
        check_output_folder(tmp_path / "used", "y", overwrite=False)


def test_generate_refuses_a_foreign_out_folder_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.png").write_bytes(b"not mine")
    code = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a cat", "--out", str(out)])
    assert code == 2
    _one_error_line(capsys, out)
    assert (out / "holiday.png").read_bytes() == b"not mine"


def test_generate_writes_a_marker_and_may_rewrite_its_own_folder(tiny_sd3_path, tmp_path):
    out = tmp_path / "samples"
    argv = ["generate", "--model", str(tiny_sd3_path), "--prompt", "a cat", "--out", str(out), "--steps", "2"]
    assert main([*argv, "--prompt", "a dog"]) == 0
    assert "stats.json" in read_marker(out, "generate")["files"] and len(list(out.glob("*.png"))) == 2
    (out / "notes.txt").write_text("mine")  # with the marker present, only generate's own files are replaced
    assert main(argv) == 0
    assert len(list(out.glob("*.png"))) == 1 and (out / "notes.txt").read_text() == "mine"


def test_data_and_bench_refuse_an_existing_file(tmp_path, capsys):
    target = tmp_path / "prompts.jsonl"
    target.write_text("mine\n")
    assert main(["data", "ocr", "--num", "3", "--out", str(target)]) == 2
    _one_error_line(capsys, target)
    assert target.read_text() == "mine\n"
    assert main(["data", "ocr", "--num", "3", "--out", str(target), "--overwrite"]) == 0
    assert len(target.read_text().splitlines()) == 3

    report = tmp_path / "bench.json"
    report.write_text("{}")
    assert main(["bench", "rollout", "--model", "tiny-sd3", "--json", str(report)]) == 2
    _one_error_line(capsys, report)
    assert report.read_text() == "{}"
