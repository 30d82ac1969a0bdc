#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Build a compatibility environment: the default environment of ``uv.lock`` with vLLM (and the torch it needs)
overridden to another release.

``uv.lock`` stays the one lock of the workspace (vLLM 0.11.0, torch 2.8.0). For another vLLM release this script:

1. exports the lock (``uv export --frozen``, third-party pins only) into ``<venv>/lock.txt``;
2. writes the overrides ``vllm==<version>`` and ``torch==<torch>`` (the torch that vLLM release's PyPI wheel pins,
   from ``TESTED_RELEASES`` in ``vllm_npu/interface/vllm_line.py``; ``--torch`` for a release not in the table);
3. resolves the dev group (the workspace members editable, the same extras) with those overrides, the lock's pins as
   preferences (``uv pip compile`` keeps every pin of its output file that still fits), into ``<venv>/compat.txt``:
   only what the new vLLM / torch require moves (torchvision, xformers, triton, flashinfer...);
4. creates ``<venv>`` and installs exactly ``compat.txt`` (``uv pip sync``).

``<venv>/compat.txt`` minus ``lock.txt`` is what changed; the script prints that diff.

With ``--check`` it then runs the compatibility job in that environment (``.ci/run`` does, for every tested release
but the pinned one): the vLLM drift guard (tests/test_vllm_surface.py), ``vllm-npu demo``, and the representative
engine modules (:data:`REPRESENTATIVE`: dense, MoE, MLA, two graph modes, quantization, LoRA, speculative decoding,
prefill-decode disaggregation), and prints one line per step; exit 1 when any fails.

Usage: python3 scripts/compat_env.py 0.11.2 [--venv /path] [--python 3.11] [--torch 2.9.0] [--check]
       python3 scripts/compat_env.py --tested           the releases of TESTED_RELEASES but the pinned one

Standard library only (it runs before anything is installed); needs uv.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINE_MODULE = ROOT / "packages/npu-interface/src/vllm_npu/interface/vllm_line.py"


def _line() -> object:
    spec = importlib.util.spec_from_file_location("_vllm_line", LINE_MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves the module of the classes it builds
    spec.loader.exec_module(module)
    return module


def torch_for(vllm_version: str) -> str:
    """The torch the PyPI wheel of ``vllm_version`` pins, from the tested-releases table."""
    found = _line().release(vllm_version)  # type: ignore[attr-defined]
    if found is None:
        raise SystemExit(f"vLLM {vllm_version} is not in TESTED_RELEASES ({LINE_MODULE}); pass --torch <version>")
    return str(found.torch)


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def dev_requirements() -> list[str]:
    """The root ``dev`` group as pip requirement lines: workspace members as editable paths (with their extras)."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    members = {p.name: p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    members["npu-testkit"] = ROOT / "testkit"
    lines = []
    for requirement in root["dependency-groups"]["dev"]:
        name_match = _NAME.match(requirement)
        assert name_match is not None, requirement
        name = name_match.group(0)
        if name in members:
            extras = requirement[len(name) :].strip()
            lines.append(f"-e {members[name]}{extras}")
        else:
            lines.append(requirement)
    # Members the dev group reaches only through extras (npu-platform[all]) are still installed editable.
    listed = {line.split()[1].split("[")[0] for line in lines if line.startswith("-e ")}
    lines += [f"-e {path}" for path in members.values() if str(path) not in listed]
    return lines


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith(("#", "-")):
            name, _, rest = line.partition("==")
            out[name.strip().lower()] = rest.split(";")[0].strip()
    return out


def build(vllm_version: str, venv: Path, python: str, torch: str) -> None:
    venv.parent.mkdir(parents=True, exist_ok=True)
    run(["uv", "venv", "--clear", "--python", python, str(venv)])
    lock = venv / "lock.txt"
    run(
        ["uv", "export", "--frozen", "--no-hashes", "--no-header", "--no-emit-workspace", "-o", str(lock)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    requirements = venv / "requirements.in"
    requirements.write_text("\n".join(dev_requirements()) + "\n")
    overrides = venv / "overrides.txt"
    overrides.write_text(f"vllm=={vllm_version}\ntorch=={torch}\n")
    compat = venv / "compat.txt"
    compat.write_text(lock.read_text())  # preferences: uv pip compile keeps the output file's pins that still fit
    run(
        [
            "uv", "pip", "compile", str(requirements), "-o", str(compat), "--override", str(overrides),
            "--python", str(venv / "bin" / "python"), "--no-header", "--quiet",
        ],
        cwd=ROOT,
    )  # fmt: skip
    run(["uv", "pip", "sync", "--python", str(venv / "bin" / "python"), str(compat)], cwd=ROOT)
    before, after = pins(lock), pins(compat)
    changed = sorted(n for n in after if n in before and before[n] != after[n])
    added = sorted(n for n in after if n not in before)
    print(f"compatibility environment {venv}: vLLM {vllm_version}, torch {torch}")
    print("changed from uv.lock: " + (", ".join(f"{n} {before[n]} -> {after[n]}" for n in changed) or "nothing"))
    if added:
        print("added: " + ", ".join(f"{n} {after[n]}" for n in added))


#: Engine modules the compatibility job runs (existing modules; one engine each): dense, MoE, MLA, two graph modes,
#: quantization, LoRA, speculative decoding, prefill-decode disaggregation.
REPRESENTATIVE: tuple[str, ...] = (
    "tests/e2e/test_qwen2_engine.py",
    "tests/e2e/test_moe_qwen3_engine.py",
    "tests/e2e/test_mla_deepseek_engine.py",
    "tests/e2e/test_graph_mode_full_decode.py",
    "tests/e2e/test_graph_mode_piecewise.py",
    "tests/e2e/test_quant_dense_schemes.py",
    "tests/e2e/test_lora_engine.py",
    "tests/e2e/test_spec_decode_eagle.py",
    "tests/e2e/test_pd_deepseek_mla.py",
)


#: The drift guard: vLLM's surface as each layer uses it, and the built-in patches' fingerprints on the release.
DRIFT_GUARD: tuple[str, ...] = ("tests/test_vllm_surface.py", "packages/npu-patches/tests/test_builtin_set.py")


def check(vllm_version: str, venv: Path) -> bool:
    """The compatibility job in ``venv``: drift guard, demo, representative engine modules. True if all pass."""
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # the venv has the worktree's packages installed editable
    env.pop("PYTEST_ADDOPTS", None)  # e.g. .ci/run's junit file of the main suite
    if _line().release(vllm_version) in _line().PREVIEW_RELEASES:  # type: ignore[attr-defined]
        env["VLLM_NPU_ALLOW_UNTESTED_VLLM"] = "1"  # a preview release is refused at plugin load otherwise
    python = str(venv / "bin" / "python")
    steps = [
        # the surface tables, and the patch set's fingerprints of this release (a patch of the line must fit it)
        ("drift guard", [python, "-m", "pytest", "-p", "no:xdist", "-q", *DRIFT_GUARD]),
        ("demo", [str(venv / "bin" / "vllm-npu"), "demo"]),
        ("engines", [python, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-q", "-rfE", *REPRESENTATIVE]),
    ]
    ok = True
    results = []
    for name, cmd in steps:
        start = time.monotonic()
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
        results.append(
            f"vLLM {vllm_version} {name}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - start:.0f} s"
        )
        ok = ok and rc == 0
    print("\n".join(results), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("vllm", nargs="?", help="the vLLM release, e.g. 0.11.2")
    parser.add_argument("--venv", type=Path, help="where to create it (default: .venv-compat/vllm-<version>)")
    parser.add_argument("--python", default="3.11")
    parser.add_argument("--torch", help="the torch to pair (default: the tested-releases table)")
    parser.add_argument("--check", action="store_true", help="then run the compatibility job in it")
    parser.add_argument("--tested", action="store_true", help="print the tested releases but the pinned one")
    args = parser.parse_args(argv)
    line = _line()
    if args.tested:
        print(" ".join(r.vllm for r in line.TESTED_RELEASES if r != line.PINNED_RELEASE))  # type: ignore[attr-defined]
        return 0
    if args.vllm is None:
        parser.error("give a vLLM release (or --tested)")
    venv = (args.venv or ROOT / ".venv-compat" / f"vllm-{args.vllm}").resolve()
    build(args.vllm, venv, args.python, args.torch or torch_for(args.vllm))
    return 0 if not args.check or check(args.vllm, venv) else 1


if __name__ == "__main__":
    raise SystemExit(main())
