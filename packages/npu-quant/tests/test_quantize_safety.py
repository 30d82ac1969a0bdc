# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu quantize`` never damages a user's files: every refusal names the cause and the fix, and afterwards the
input (and any existing output) is byte for byte what it was; a failure or Ctrl-C while writing leaves no output."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from vllm_npu.quant.tools import quantizer
from vllm_npu.quant.tools.cli import main

SCHEME = "W8A8_DYNAMIC"


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones included) -> sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.fixture
def float_dir(tmp_path: Path) -> Path:
    """A private copy of the tiny float checkpoint (tests may point the output into or around it)."""
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    copy = tmp_path / "model"
    shutil.copytree(build_tiny_model(tiny_config("qwen2")), copy)
    return copy


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def no_staging_left(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_output_equal_to_input_is_refused(float_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(float_dir)
    err = refused([str(float_dir), str(float_dir), "--scheme", SCHEME], capsys)
    assert "is the input checkpoint; choose a new output directory" in err
    # --overwrite does not change that, nor does another spelling of the same path
    err = refused([str(float_dir), str(float_dir / ".." / "model"), "--scheme", SCHEME, "--overwrite"], capsys)
    assert "is the input checkpoint" in err
    assert snapshot(float_dir) == before


def test_output_inside_the_input_is_refused(float_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(float_dir)
    err = refused([str(float_dir), str(float_dir / "quantized"), "--scheme", SCHEME, "--overwrite"], capsys)
    assert f"is inside the input checkpoint {float_dir}; choose a new output directory" in err
    assert snapshot(float_dir) == before
    assert not (float_dir / "quantized").exists()


def test_output_around_the_input_is_refused_even_with_overwrite(
    float_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(float_dir)
    err = refused([str(float_dir), str(float_dir.parent), "--scheme", SCHEME, "--overwrite"], capsys)
    assert "contains the input checkpoint" in err and "would delete the input" in err
    assert snapshot(float_dir) == before


def test_non_empty_output_is_refused_without_overwrite(
    float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's file")
    err = refused([str(float_dir), str(out), "--scheme", SCHEME], capsys)
    assert "exists and is not empty; choose a new output directory or pass --overwrite to replace it" in err
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"the user's file").hexdigest()}


def test_output_under_a_file_is_refused(float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    err = refused([str(float_dir), str(tmp_path / "file" / "q"), "--scheme", SCHEME], capsys)
    assert f"lies under {tmp_path / 'file'}, which is a file, not a directory; choose a new output" in err


def test_output_that_is_a_file_is_refused(float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "file"
    out.write_text("x")
    err = refused([str(float_dir), str(out), "--scheme", SCHEME, "--overwrite"], capsys)
    assert "exists and is not a directory" in err
    assert out.read_text() == "x"


def test_overwrite_replaces_a_non_empty_output_and_an_empty_one_needs_no_flag(float_dir: Path, tmp_path: Path) -> None:
    before = snapshot(float_dir)
    out = tmp_path / "q"
    out.mkdir()
    assert main([str(float_dir), str(out), "--scheme", SCHEME]) == 0  # an empty directory is fine
    (out / "stale.txt").write_text("from an older run")
    assert main([str(float_dir), str(out), "--scheme", SCHEME, "--overwrite"]) == 0
    assert not (out / "stale.txt").exists()
    assert (out / "quant_model_description.json").is_file()
    assert snapshot(float_dir) == before
    assert no_staging_left(tmp_path)


def test_already_quantized_input_is_refused_by_name(
    float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = tmp_path / "ours"
    assert main([str(float_dir), str(ours), "--scheme", SCHEME]) == 0
    capsys.readouterr()
    err = refused([str(ours), str(tmp_path / "again"), "--scheme", "W8A8"], capsys)
    assert f"{ours} is already quantized (it has quant_model_description.json)" in err
    assert "pass the float (unquantized) checkpoint it was made from" in err
    assert "Traceback" not in err
    # another method's checkpoint: named by its quant_method
    fp8 = tmp_path / "fp8"
    shutil.copytree(float_dir, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    err = refused([str(fp8), str(tmp_path / "q8"), "--scheme", SCHEME], capsys)
    assert "is already quantized (config.json: quantization_config 'fp8')" in err
    assert not (tmp_path / "again").exists() and not (tmp_path / "q8").exists()


@pytest.mark.parametrize("interrupt", [OSError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "overwrite"])
def test_a_failure_while_writing_leaves_no_output(
    float_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    interrupt: BaseException,
    existing: bool,
) -> None:
    before = snapshot(float_dir)
    out = tmp_path / "q"
    if existing:
        out.mkdir()
        (out / "previous.txt").write_text("an earlier result")
    written: list[Path] = []

    def failing_copy(src: str, dst: str) -> None:
        # the weights and the description are already written when the tokenizer files are copied
        written.extend(Path(dst).parent.iterdir())
        raise interrupt

    monkeypatch.setattr(quantizer.shutil, "copy2", failing_copy)
    argv = [str(float_dir), str(out), "--scheme", SCHEME, *(["--overwrite"] if existing else [])]
    if isinstance(interrupt, KeyboardInterrupt):
        assert main(argv) == 130
        assert f"interrupted; {out} was left as it was" in capsys.readouterr().err
    else:
        assert main(argv) == 2
        assert f"cannot write {out}: disk full; the output was left as it was" in capsys.readouterr().err
    assert any(p.name == "quant_model_weights.safetensors" for p in written), "the failure came mid-write"
    if existing:
        assert snapshot(out) == {"previous.txt": hashlib.sha256(b"an earlier result").hexdigest()}
    else:
        assert not out.exists()
    assert no_staging_left(tmp_path)
    assert snapshot(float_dir) == before


def test_bad_inputs_and_options_are_clear_errors(
    float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "q")
    before = snapshot(float_dir)
    cases = [
        (["--scheme", "W8A8", "--group-size", "32"], "--group-size applies only to --scheme W4A8_DYNAMIC, not W8A8"),
        (["--scheme", SCHEME, "--calib-file", "p.txt"], "--calib-file applies only to --scheme W8A8"),
        (["--scheme", "W8A8", "--seed", "3"], "--seed applies only to --scheme W4A4_FLATQUANT"),
        (["--scheme", "W4A8_DYNAMIC", "--group-size", "0"], "group size must be a positive integer, got 0"),
        (["--scheme", "W8A8", "--calib-file", str(tmp_path / "absent.txt")], "cannot read the calibration file"),
        (["--scheme", "W4A4_FLATQUANT", "--clip-ratio", "0"], "clip ratio must lie in (0, 1], got 0.0"),
    ]
    for args, message in cases:
        err = refused([str(float_dir), out, *args], capsys)
        assert message in err, (args, err)
        assert "Traceback" not in err
    # a directory without weights, or with a config.json that is not JSON / has a non-float dtype
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(float_dir / "config.json", no_weights / "config.json")
    assert "transformers cannot load" in refused([str(no_weights), out, "--scheme", SCHEME], capsys)
    (no_weights / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in refused([str(no_weights), out, "--scheme", SCHEME], capsys)
    cfg = json.loads((float_dir / "config.json").read_text())
    (no_weights / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "int8"}))
    assert "torch_dtype 'int8' is not a floating-point torch dtype" in refused(
        [str(no_weights), out, "--scheme", SCHEME], capsys
    )
    assert not Path(out).exists()
    assert snapshot(float_dir) == before
