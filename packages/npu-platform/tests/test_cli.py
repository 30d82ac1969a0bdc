# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ``vllm-npu`` command: help without heavy imports, dispatch through the subcommand table, absent layers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm_npu.platform import __version__
from vllm_npu.platform.tools import cli
from vllm_npu.platform.tools.cli import EXIT_MISSING, SUBCOMMANDS, Subcommand

HEAVY = ("torch", "torch_npu", "vllm", "transformers")

# Runs the CLI in a fresh interpreter and appends the heavy modules it imported.
_RUNNER = textwrap.dedent(
    """
    import json, sys
    from vllm_npu.platform.tools.cli import main
    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
    print("@@HEAVY@@" + json.dumps(sorted(m for m in HEAVY_NAMES if m in sys.modules)))
    sys.exit(rc)
    """
).replace("HEAVY_NAMES", repr(HEAVY))


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _RUNNER, *args], capture_output=True, text=True, timeout=120, env=env)
    out, _, heavy = proc.stdout.rpartition("@@HEAVY@@")
    return proc.returncode, out, proc.stderr, json.loads(heavy)


def test_help_lists_every_subcommand_without_heavy_imports() -> None:
    rc, out, _, heavy = run_cli("--help")
    assert rc == 0
    for name in SUBCOMMANDS:
        assert name in out
    assert heavy == []


def test_console_script_is_installed() -> None:
    script = shutil.which("vllm-npu", path=str(Path(sys.executable).parent)) or shutil.which("vllm-npu")
    assert script, "the vllm-npu console script is not installed"
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"npu-platform {__version__}"


def test_no_command_prints_usage() -> None:
    rc, out, _, _ = run_cli()
    assert rc == EXIT_MISSING and "usage: vllm-npu" in out


def test_unknown_command_is_a_usage_error() -> None:
    rc, _, err, _ = run_cli("frobnicate")
    assert rc == 2 and "invalid choice: 'frobnicate'" in err


def test_subcommand_table_is_strings_only() -> None:
    for name, sub in SUBCOMMANDS.items():
        module, _, func = sub.target.partition(":")
        assert module.startswith(f"vllm_npu.{sub.layer}.") and func, name
    assert SUBCOMMANDS["doctor"].target == "vllm_npu.platform.tools.cli.doctor:main"
    assert SUBCOMMANDS["demo"].target == "vllm_npu.platform.tools.demo:main"
    assert SUBCOMMANDS["patches"].target == "vllm_npu.patches.cli:main"
    assert SUBCOMMANDS["quantize"].target == "vllm_npu.quant.tools.cli:main"


@pytest.fixture
def tool_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "npu_cli_test_tool.py").write_text(
        "CALLS = []\ndef main(argv):\n    CALLS.append(list(argv))\n    return 3 if '--fail' in argv else None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "npu_cli_test_tool"
    sys.modules.pop("npu_cli_test_tool", None)


def test_dispatch_passes_the_remaining_arguments(tool_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SUBCOMMANDS, "tool", Subcommand(f"{tool_module}:main", "platform", "a test tool"))
    assert cli.main(["tool", "--x", "1", "--help"]) == 0
    assert cli.main(["tool", "--fail"]) == 3
    assert sys.modules[tool_module].CALLS == [["--x", "1", "--help"], ["--fail"]]


def test_absent_layer_prints_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = cli.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "vllm_npu.quant" or name.startswith("vllm_npu.quant.") else real_find_spec(name, *args)

    monkeypatch.setattr(cli.importlib.util, "find_spec", find_spec)
    assert cli.main(["quantize", "--help"]) == EXIT_MISSING
    err = capsys.readouterr().err
    assert err.strip() == (
        'vllm-npu: `vllm-npu quantize` needs the quant layer; install the quant layer: pip install "npu-platform[quant]"'
    )


def test_layer_without_the_subcommand_module(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(SUBCOMMANDS, "ghost", Subcommand("vllm_npu.ops.no_such_cli_module:main", "ops", "x"))
    assert cli.main(["ghost"]) == EXIT_MISSING
    err = capsys.readouterr().err
    assert "needs vllm_npu.ops.no_such_cli_module, which npu-ops" in err and "pip install -U npu-ops" in err


def test_python_dash_m(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_npu.platform.tools.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ},
    )
    assert proc.returncode == 0 and __version__ in proc.stdout
