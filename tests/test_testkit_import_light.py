# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu_testkit.import_light.assert_import_light``, the helper of every "import stays light" test: it must fail on a
forbidden import and on a failing check, or those tests pass vacuously. Standard-library modules stand in for torch
and vLLM (importing torch in a child costs seconds)."""

from __future__ import annotations

import pytest
from npu_testkit.import_light import assert_import_light


def test_a_light_import_passes_and_returns_what_it_printed() -> None:
    assert assert_import_light("import json", "print(json.dumps([1]))", forbid=("decimal",)) == "[1]\n"


def test_a_forbidden_import_fails_naming_it() -> None:
    with pytest.raises(AssertionError, match=r"pulled in decimal,"):
        assert_import_light("import json", "import decimal", forbid=("decimal",))


def test_the_default_forbids_torch_torch_npu_and_vllm() -> None:
    with pytest.raises(AssertionError, match=r"pulled in torch,"):
        assert_import_light("import sys, types", "sys.modules['torch'] = types.ModuleType('torch')")


def test_a_failing_check_fails_with_its_error() -> None:
    with pytest.raises(AssertionError, match="the code under test failed"):
        assert_import_light("import json", "assert json.loads('[]'), 'empty'")
