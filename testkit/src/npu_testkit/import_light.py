# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The "import stays light" check: vLLM loads plugins in every process, so a door, an entry point or a registry
must not import torch, torch_npu or vLLM. Run in a fresh interpreter (this one has them loaded already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping

HEAVY = ("torch", "torch_npu", "vllm")


def assert_import_light(
    *code: str, forbid: tuple[str, ...] = HEAVY, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> str:
    """Run ``code`` (statements, each a line or a block: the imports under test and any checks of what they
    return) in a fresh interpreter, then fail naming every module of ``forbid`` it left in ``sys.modules``.

    ``env`` is the child's whole environment (default: this process's). Returns the child's stdout (what ``code``
    printed). A failure of ``code`` itself (an ``assert`` in it, an ImportError) fails with the child's stderr.
    """
    script = "\n".join(textwrap.dedent(c).strip("\n") for c in code)
    script += (
        f"\nimport sys as _sys\n_heavy = sorted(m for m in {tuple(forbid)!r} if m in _sys.modules)\n"
        "print('\\n' + 'HEAVY:' + ','.join(_heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ if env is None else env),
    )
    assert proc.returncode == 0, f"the code under test failed:\n{script}\n--- stderr ---\n{proc.stderr[-3000:]}"
    out, _, heavy = proc.stdout.rpartition("\nHEAVY:")
    heavy = heavy.strip()
    assert not heavy, f"importing this pulled in {heavy}, which must stay unimported:\n{script}"
    return out
