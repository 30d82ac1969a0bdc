# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Declaring and listing patches imports neither torch nor vLLM (vLLM loads our plugin in every process)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import vllm_npu.patches._component
from vllm_npu.patches import get_registry, Patch
reg = get_registry()
assert reg.ids(), reg.ids()
heavy = sorted(m for m in ("torch", "vllm", "torch_npu") if m in sys.modules)
print(",".join(heavy))
"""


def test_registry_and_component_are_import_light():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"imported at declaration time: {out.stdout.strip()}"
