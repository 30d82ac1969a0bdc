# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The bad-input suite's CLI surface: every ``vllm-npu`` subcommand given bad arguments or a bad environment answers
with an error that names the cause (exit status 1 or 2, no traceback), within a bounded time (never hangs), leaves
no process behind and leaves the user's files as they were.

No engine starts here (each case is one short ``vllm-npu`` process). The quantizer's own refusals are tested in
depth in packages/npu-quant/tests/test_quantize_safety.py; the process surface with a server
(``kill -9``, SIGTERM mid-stream) is tests/e2e/test_process_lifecycle.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

#: Seconds one bad invocation may take (the selftest case imports torch and vLLM).
BOUND_S = 180
SCRIPT = shutil.which("vllm-npu", path=str(Path(sys.executable).parent)) or "vllm-npu"

#: (id, arguments, extra environment, exit status, text the error must contain)
CASES = [
    ("unknown-command", ["bogus"], {}, 2, "invalid choice: 'bogus'"),
    ("doctor-unknown-flag", ["doctor", "--bogus"], {}, 2, "unrecognized arguments: --bogus"),
    (
        "doctor-bad-device",
        ["doctor"],
        {"VLLM_NPU_DEVICE": "bogus"},
        1,
        "VLLM_NPU_DEVICE='bogus' is invalid; allowed: 'auto', 'npu', 'emulated', 'off'",
    ),
    (
        "doctor-bad-kv-budget",
        ["doctor"],
        {"VLLM_NPU_EMULATED_KV_CACHE_GB": "abc"},
        1,
        "VLLM_NPU_EMULATED_KV_CACHE_GB='abc' is invalid",
    ),
    ("doctor-unknown-variable", ["doctor"], {"VLLM_NPU_BOGUS": "1"}, 1, "VLLM_NPU_BOGUS is not a known key"),
    ("selftest-unknown-op", ["selftest", "--op", "bogus"], {}, 2, "--op bogus names no kernel; known: add_rms_norm"),
    (
        "selftest-npu-without-npu",
        ["selftest", "--no-e2e"],
        {"VLLM_NPU_DEVICE": "npu"},
        2,
        "VLLM_NPU_DEVICE=npu was requested but this host cannot run it",
    ),
    ("patches-unknown-flag", ["patches", "--bogus"], {}, 2, "unrecognized arguments: --bogus"),
    (
        "patches-unknown-id",
        ["patches"],
        {"VLLM_NPU_PATCHES": "-nope"},
        2,
        "VLLM_NPU_PATCHES=-nope names unknown patch id(s) 'nope'; known ids:",
    ),
    (
        "patches-output-dir-missing",
        ["patches", "--markdown", "--output", "/nonexistent-dir/patches.md"],
        {},
        2,
        "cannot write /nonexistent-dir/patches.md: No such file or directory",
    ),
    ("pd-proxy-no-urls", ["pd-proxy"], {}, 2, "the following arguments are required: --prefill, --decode"),
    *[
        (f"pd-proxy-{name}", ["pd-proxy", "--prefill", url, "--decode", "http://127.0.0.1:8200"], {}, 2, message)
        for name, url, message in [
            ("not-a-url", "notaurl", "'notaurl' is not an http(s) URL"),
            ("ftp", "ftp://127.0.0.1:8100", "is not an http(s) URL"),
            ("no-host", "http://", "is not an http(s) URL"),
            ("bad-url-port", "http://127.0.0.1:99999", "'http://127.0.0.1:99999' has an invalid port"),
            ("url-with-path", "http://127.0.0.1:8100/v1", "must be an instance's base URL without a path"),
        ]
    ],
    (
        "pd-proxy-bad-port",
        ["pd-proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--port", "99999"],
        {},
        2,
        "--port 99999 is not a TCP port (1-65535)",
    ),
    (
        "pd-proxy-zero-timeout",
        ["pd-proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--timeout", "0"],
        {},
        2,
        "--timeout 0.0 must be a positive number of seconds",
    ),
    ("demo-zero-tokens", ["demo", "--max-tokens", "0"], {}, 2, "argument --max-tokens: must be at least 1, got 0"),
    ("demo-not-a-number", ["demo", "--max-tokens", "abc"], {}, 2, "argument --max-tokens: invalid int value: 'abc'"),
    ("demo-blank-prompt", ["demo", "--prompt", " "], {}, 2, "a prompt needs at least one non-blank character"),
    ("demo-bad-dtype", ["demo", "--dtype", "int8"], {}, 2, "argument --dtype: invalid choice: 'int8'"),
    ("quantize-no-args", ["quantize"], {}, 2, "the following arguments are required: model_dir, out_dir, --scheme"),
    (
        "quantize-missing-input",
        ["quantize", "/nonexistent-model", "{tmp}/q", "--scheme", "W8A8"],
        {},
        2,
        "/nonexistent-model has no config.json; pass a Hugging Face checkpoint directory",
    ),
    ("quantize-bad-scheme", ["quantize", "{tmp}", "{tmp}/q", "--scheme", "W3A3"], {}, 2, "invalid choice: 'W3A3'"),
]


def leftover_processes(marker: str) -> list[tuple[int, str]]:
    """Processes whose environment carries ``marker`` (started by the command under test, directly or not)."""
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.environ().get("NPU_TEST_PROCESS_MARKER") == marker:
                found.append((proc.pid, proc.info["name"]))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def run(args: list[str], env_extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, "VLLM_NPU_CACHE_DIR": str(tmp_path / "cache"), **env_extra, "NPU_TEST_PROCESS_MARKER": marker}
    if env_extra.get("VLLM_NPU_DEVICE") is None:
        env.setdefault("VLLM_NPU_DEVICE", "emulated")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert leftover_processes(marker) == [], "the command left processes behind"
    return proc


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(("args", "env", "status", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation_is_a_clear_error(tmp_path: Path, args, env, status, message) -> None:
    (tmp_path / "user_file.txt").write_text("the user's own file")
    before = snapshot(tmp_path)
    proc = run(args, env, tmp_path)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert message in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # nothing of the user's changed, nothing was created (the demo cases build no model: VLLM_NPU_CACHE_DIR stays
    # absent)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_file.txt"]


def test_quantize_onto_its_input_leaves_the_input_byte_identical(tiny_qwen2: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    before = snapshot(model)
    proc = run(["quantize", str(model), str(model), "--scheme", "W8A8_DYNAMIC"], {}, tmp_path)
    assert proc.returncode == 2
    assert "is the input checkpoint; choose a new output directory" in proc.stderr
    assert snapshot(model) == before


def test_demo_with_a_file_as_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    proc = run(["demo", "--max-tokens", "2"], {"VLLM_NPU_CACHE_DIR": str(cache)}, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot build the demo model under {cache}: it is not a directory" in proc.stderr
    assert cache.read_text() == "not a directory"
