# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` without an engine: the kernel rows on the emulated device, ``--json``, ``--op``, exit codes,
the refusal without an NPU, coverage of every kernel pair in the sources, and the NPU path against a stand-in
``torch_npu`` whose wrong results must show as failures. The end-to-end generate with a real engine is
``tests/e2e/test_selftest.py``; its comparison logic is tested here with fake legs."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from vllm_npu.interface import DeviceDecision, DeviceMode, reset_device_selection
from vllm_npu.platform.tools.cli import SUBCOMMANDS, main, selftest
from vllm_npu.platform.tools.cli import _kernel_check as kc

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def device_env(monkeypatch):
    """Restore VLLM_NPU_DEVICE (the selftest pins it for its process) and the process's device decision."""
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    yield monkeypatch
    reset_device_selection()


def _run(capfd, *args: str) -> tuple[int, str, str]:
    rc = main(["selftest", *args])
    out, err = capfd.readouterr()
    return rc, out, err


def _report(out: str) -> dict:
    """The JSON document of an in-process run. In pytest, vLLM's log handler writes to pytest's capture of
    sys.stdout rather than fd 1, so log lines can precede it; a real run's stdout is the document alone (checked
    by the subprocess test)."""
    return json.loads(out[out.index("{\n") if not out.startswith("{") else 0 :])


def test_registered_as_a_platform_subcommand() -> None:
    assert SUBCOMMANDS["selftest"].target == "vllm_npu.platform.tools.cli.selftest:main"


def test_emulated_kernel_rows_all_pass_and_json_parses() -> None:
    env = {**os.environ, "VLLM_NPU_DEVICE": "emulated"}
    proc = subprocess.run(
        # the kernel rows; the runtime section's real run is tests/e2e/test_selftest.py
        [sys.executable, "-m", "vllm_npu.platform.tools.cli", "selftest", "--no-e2e", "--no-runtime", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout is the JSON document alone (vLLM's logs went to stderr)
    assert report["ok"] is True and report["e2e"] is None
    assert report["device"]["mode"] == "emulated" and report["device"]["kernel_backend"] == "reference"
    assert report["versions"]["npu-platform"] and report["versions"]["torch"]
    rows = report["rows"]
    assert rows and all(r["status"] == "pass" for r in rows), [r for r in rows if r["status"] != "pass"]
    assert report["summary"] == {"pass": len(rows), "fail": 0, "skip": 0}
    # every kernel pair of the sources has rows, and the MLA sizes the NPU kernels require are on the grid
    _, _, names = kc.collect()
    assert {r["op"] for r in rows} == names
    assert any(r["op"] == "mla_decode" and "[3, 128, 512]" in r["shape"] for r in rows)
    assert {r["dtype"] for r in rows if r["op"] == "ring_mla"} == {"bfloat16", "float16"}


def test_text_report_states_the_tolerances_and_the_emulated_caveat(device_env, capfd) -> None:
    rc, out, _ = _run(capfd, "--op", "swiglu")
    assert rc == 0
    assert "no NPU kernel runs here" in out and "bfloat16 atol=0.016 rtol=0.016" in out
    assert "swiglu" in out and "Result: PASS" in out and "end to end" not in out


def test_op_filter_takes_names_and_patterns(device_env, capfd) -> None:
    rc, out, _ = _run(capfd, "--op", "rms_norm", "--op", "npu_grouped_matmul*", "--json")
    assert rc == 0
    report = _report(out)
    assert {r["op"] for r in report["rows"]} == {
        "rms_norm",
        "npu_grouped_matmul[int8,per-token]",
        "npu_grouped_matmul[int8 x int4,per-group int64 scale,bias]",
        "npu_grouped_matmul[int8,per-channel,int32 bias]",
    }
    assert report["e2e"] is None  # --op is a kernel-only run


def test_unknown_op_is_refused_with_the_known_names(device_env, capfd) -> None:
    rc, _, err = _run(capfd, "--op", "rms_nrom")
    assert rc == selftest.EXIT_CANNOT_RUN
    assert "--op rms_nrom names no kernel" in err and "rms_norm" in err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("npu", "VLLM_NPU_DEVICE=npu was requested but this host cannot run it"),
        ("off", "VLLM_NPU_DEVICE=off turns the plugin off"),
        ("gpu", "VLLM_NPU_DEVICE"),
    ],
)
def test_refuses_when_the_device_cannot_run(device_env, capfd, value, expected) -> None:
    device_env.setenv("VLLM_NPU_DEVICE", value)
    rc, out, err = _run(capfd, "--no-e2e", "--json")
    assert rc == selftest.EXIT_CANNOT_RUN
    assert expected in err
    report = json.loads(out)  # nothing imported vLLM yet: stdout is the document alone
    assert report["ok"] is False and expected in report["error"] and report["versions"]["npu-platform"]


# --- coverage -----------------------------------------------------------------------------------------------------


def test_every_kernel_pair_in_the_sources_has_a_selftest_case() -> None:
    """A ``Kernel(...)`` anywhere in packages/*/src without a case (or in a layer the selftest does not scan)
    fails here."""
    found = []
    for src in sorted(REPO.glob("packages/*/src/vllm_npu/*")):
        if src.name == "interface" or not src.is_dir():
            continue
        kernels = kc.find_kernels_in(str(src))
        assert not kernels or src.name in kc.KERNEL_LAYERS, f"{src} has kernel pairs but is not scanned"
        found += kernels
    assert all(k.name for k in found), [k for k in found if not k.name]
    names = [k.name for k in found]
    assert len(names) == len(set(names)), "two kernel pairs share a name"
    assert len(names) >= 38
    cases, problems, _ = kc.collect()
    assert problems == []
    assert set(names) <= {case.kernel.name for _, case in cases}


def test_a_kernel_pair_without_a_case_is_a_failing_row(tmp_path, monkeypatch) -> None:
    layer = tmp_path / "vllm_npu" / "fakelayer"
    layer.mkdir(parents=True)
    (layer / "__init__.py").write_text(
        textwrap.dedent(
            """
            import torch
            from vllm_npu.interface.selftest import KernelCall, KernelCase
            from .k import COVERED, EMPTY

            def selftest_cases():
                return [
                    KernelCase(COVERED, "x [2]", "float32", lambda d: KernelCall((torch.ones(2, device=d),), {})),
                    KernelCase(EMPTY, "x [2]", "float32", lambda d: KernelCall((torch.ones(2),), {}, lambda r, a, k: {})),
                ]
            """
        )
    )
    (layer / "k.py").write_text(
        textwrap.dedent(
            """
            import torch
            from vllm_npu.interface import Kernel

            COVERED = Kernel("covered", npu=torch.neg, reference=torch.neg)
            EMPTY = Kernel("compares nothing", npu=torch.neg, reference=torch.neg)
            FORGOTTEN = Kernel("forgotten", npu=torch.neg, reference=torch.neg)
            """
        )
    )
    broken = tmp_path / "vllm_npu" / "brokenlayer"
    broken.mkdir()
    (broken / "__init__.py").write_text("def selftest_cases():\n    raise ImportError('no torch here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = kc.layer_source_dir
    monkeypatch.setattr(kc, "layer_source_dir", lambda layer: None if layer == "models" else installed(layer))
    rows = kc.run("reference", "cpu", layers=("fakelayer", "brokenlayer", "models"))
    by_op = {r.op: r for r in rows}
    assert by_op["forgotten"].status == kc.FAIL and "no selftest case" in by_op["forgotten"].detail
    assert "fakelayer/k.py:7" in by_op["forgotten"].detail
    assert by_op["covered"].status == kc.PASS
    assert by_op["compares nothing"].status == kc.FAIL and "compares no output" in by_op["compares nothing"].detail
    (broken_row,) = [r for r in rows if r.layer == "brokenlayer"]
    assert broken_row.status == kc.FAIL and broken_row.detail == "selftest_cases() raised ImportError: no torch here"
    missing = [r for r in rows if r.layer == "models"]
    assert [r.status for r in missing] == [kc.SKIP]
    assert missing[0].detail == 'skipped: layer not installed (pip install "npu-platform[models]")'
    for name in [m for m in sys.modules if m.startswith(("vllm_npu.fakelayer", "vllm_npu.brokenlayer"))]:
        monkeypatch.delitem(sys.modules, name)


def test_compare_reports_errors_and_tolerances() -> None:
    ref = torch.tensor([1.0, -2.0, float("-inf"), 0.0])
    assert kc.compare(ref.clone(), ref, 1e-4, 1e-4)[:3] == (True, 0.0, 0.0)
    ok, max_abs, max_rel, _ = kc.compare(ref + torch.tensor([0.0, 0.5, 0.0, 0.0]), ref, 1e-4, 1e-4)
    assert not ok and max_abs == 0.5 and max_rel == 0.25
    assert not kc.compare(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0, 1.0)[0]
    assert not kc.compare(ref.half(), ref, 1.0, 1.0)[0]  # a dtype other than the reference's is a contract break
    ints = torch.tensor([3, -4], dtype=torch.int8)
    assert kc.compare(ints + 1, ints, 0, 0, int_atol=1)[0] and not kc.compare(ints + 1, ints, 0, 0)[0]


# --- the NPU path, against a stand-in torch_npu --------------------------------------------------------------------


class _FakeTorchNPU(types.ModuleType):
    """``torch_npu`` whose rms_norm is off by 2 % (a wrong kernel), whose swiglu is right and whose fast_gelu rejects
    its input (a binding that refuses the call)."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)

    def npu_rms_norm(self, x, gamma, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * rstd * gamma.float() * 1.02).to(x.dtype), rstd

    def npu_swiglu(self, x, dim=-1):
        a, b = x.float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(a) * b).to(x.dtype)

    def npu_fast_gelu(self, x):
        raise RuntimeError("EZ1001: the fake binding rejects this call")


def test_npu_path_reports_a_wrong_kernel_as_a_failure(device_env, capfd) -> None:
    # Import the layers (and let vLLM resolve its platform) while the device is still the emulated one: with
    # VLLM_NPU_DEVICE=npu on this host the platform hook refuses to activate, as it should.
    kc.collect()
    from vllm.platforms import current_platform

    assert current_platform.device_type
    device_env.setitem(sys.modules, "torch_npu", _FakeTorchNPU())
    device_env.setattr(selftest, "decide_device", lambda: DeviceDecision("npu", DeviceMode.NPU, "fake NPU"))
    device_env.setattr(selftest, "npu_device", lambda: torch.device("cpu"))  # the stand-in computes on the CPU
    released = []
    device_env.setattr(selftest, "release_npu", lambda: released.append(True))
    device_env.setitem(sys.modules, "custom_ops", None)  # the Ascend custom_ops package is absent: import fails
    ops = ("rms_norm", "swiglu", "fast_gelu", "lightning_indexer")
    rc, out, _ = _run(capfd, *[arg for op in ops for arg in ("--op", op)], "--json")
    assert rc == selftest.EXIT_FAILED
    report = _report(out)
    assert report["ok"] is False and report["device"]["kernel_backend"] == "npu"
    status = {(r["op"], r["dtype"], r["shape"]): r for r in report["rows"]}
    norms = [r for (op, _, _), r in status.items() if op == "rms_norm"]
    assert norms and all(r["status"] == "FAIL" and r["max_rel"] > 0.01 for r in norms)
    assert all("out0: max abs err" in r["detail"] for r in norms)
    assert all(r["status"] == "pass" for (op, _, _), r in status.items() if op == "swiglu")
    gelu = [r for (op, _, _), r in status.items() if op == "fast_gelu"]
    assert gelu and all(r["status"] == "FAIL" and "EZ1001" in r["detail"] for r in gelu)
    assert report["summary"]["fail"] == len(norms) + len(gelu)
    # a kernel whose NPU package is missing is skipped with the fix, not failed
    (indexer,) = [r for (op, _, _), r in status.items() if op == "lightning_indexer"]
    assert indexer["status"] == "skip" and "custom_ops" in indexer["detail"]
    assert report["summary"]["skip"] == 1
    assert released == [True]


# --- end-to-end comparison (fake legs; the real engine run is tests/e2e/test_selftest.py) ---------------------------


@pytest.mark.parametrize("same", [True, False])
def test_e2e_token_mismatch_fails_the_selftest(device_env, capfd, same) -> None:
    tokens = [[5, 6, 7, 8]] * len(selftest.E2E_PROMPTS)
    other = [[5, 6, 9, 8]] + tokens[1:]

    def leg(model, mode, kernels, dtype, max_tokens):
        return {"kernels": kernels, "token_ids": tokens, "texts": ["x"] * len(tokens)}

    def hf_leg(model, max_tokens):
        return {"kernels": "hf", "token_ids": tokens if same else other, "texts": ["x"] * len(tokens)}

    device_env.setattr("vllm_npu.platform.tools.demo.checkpoint.ensure_demo_model", lambda: (Path("/nowhere"), False))
    device_env.setattr(selftest, "_leg", leg)
    device_env.setattr(selftest, "_hf_leg", hf_leg)
    device_env.setattr(kc, "run", lambda *a, **k: [])  # e2e only
    rc, out, _ = _run(capfd, "--json", "--max-tokens", "4", "--no-runtime")
    report = _report(out)
    assert rc == (0 if same else selftest.EXIT_FAILED)
    assert report["runtime"] is None
    assert report["e2e"]["ok"] is same
    if not same:
        (mismatch,) = report["e2e"]["mismatches"]
        assert mismatch["prompt"] == selftest.E2E_PROMPTS[0] and mismatch["first_diff"] == 2


def test_e2e_on_an_npu_compares_the_device_run_with_the_reference_kernel_run(device_env, capfd) -> None:
    kc.collect()  # import the layers while the device is the emulated one (see the NPU path test)
    calls = []

    def leg(model, mode, kernels, dtype, max_tokens):
        calls.append((mode, kernels, dtype))
        ids = [[1, 2, 3]] * len(selftest.E2E_PROMPTS) if kernels == "auto" else [[1, 2, 4]] * len(selftest.E2E_PROMPTS)
        return {"kernels": kernels, "token_ids": ids, "texts": ["x"] * len(ids)}

    def hf_leg(model, max_tokens):
        raise AssertionError("on an NPU the baseline is the reference-kernel run, not HF")

    device_env.setattr(selftest, "decide_device", lambda: DeviceDecision("npu", DeviceMode.NPU, "fake NPU"))
    device_env.setattr(selftest, "npu_device", lambda: torch.device("cpu"))
    device_env.setattr(selftest, "release_npu", lambda: None)
    device_env.setattr("vllm_npu.platform.tools.demo.checkpoint.ensure_demo_model", lambda: (Path("/nowhere"), False))
    device_env.setattr(selftest, "_leg", leg)
    device_env.setattr(selftest, "_hf_leg", hf_leg)
    device_env.setattr(kc, "run", lambda *a, **k: [])
    rc, out, _ = _run(capfd, "--max-tokens", "3", "--no-runtime")
    assert rc == selftest.EXIT_FAILED
    assert calls == [(DeviceMode.NPU, "auto", "bfloat16"), (DeviceMode.NPU, "reference", "bfloat16")]
    assert "FAIL: 'Four score and seven years ago' differs from token 2: [3] vs [4]" in out
    assert "Result: FAIL" in out
