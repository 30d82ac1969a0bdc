# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""DeepSeek MTP speculative decoding with 3 draft token(s), moe MTP layer, on a tiny DeepSeek-V3 (MLA) target on the
emulated device (cases: ``mtp_cases``)."""

from __future__ import annotations

import pytest
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

import_sibling(__file__, "mtp_cases").install(globals(), k=3, mlp="moe")
