# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Declaring and listing patches imports neither torch nor vLLM (vLLM loads our plugin in every process)."""

from __future__ import annotations

from npu_testkit.import_light import assert_import_light

CODE = """
import vllm_npu.patches._component
from vllm_npu.patches import get_registry, Patch
reg = get_registry()
assert reg.ids(), reg.ids()
"""


def test_registry_and_component_are_import_light():
    assert_import_light(CODE)
