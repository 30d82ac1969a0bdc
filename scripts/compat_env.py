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

Usage: python3 scripts/compat_env.py 0.11.2 [--venv /path] [--python 3.11] [--torch 2.9.0]
Then: VIRTUAL_ENV=<venv> PATH=<venv>/bin:$PATH python -m pytest -p no:xdist -q tests/test_vllm_surface.py

Standard library only (it runs before anything is installed); needs uv.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("vllm", help="the vLLM release, e.g. 0.11.2")
    parser.add_argument("--venv", type=Path, help="where to create it (default: .venv-compat/vllm-<version>)")
    parser.add_argument("--python", default="3.11")
    parser.add_argument("--torch", help="the torch to pair (default: the tested-releases table)")
    args = parser.parse_args(argv)
    venv = args.venv or ROOT / ".venv-compat" / f"vllm-{args.vllm}"
    build(args.vllm, venv.resolve(), args.python, args.torch or torch_for(args.vllm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
