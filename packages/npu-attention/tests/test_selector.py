# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""select_backend: the platform's attention-backend choice, import-light."""

from __future__ import annotations

import pytest
from npu_testkit.import_light import assert_import_light
from vllm_npu.attention.selector import GQA_BACKEND, MLA_BACKEND, SFA_BACKEND, select_backend
from vllm_npu.interface import ConfigError


def test_paths() -> None:
    assert select_backend(use_mla=False, use_sparse=False) == GQA_BACKEND
    assert select_backend(use_mla=True, use_sparse=False) == MLA_BACKEND
    assert select_backend(use_mla=True, use_sparse=True) == SFA_BACKEND
    assert GQA_BACKEND == "vllm_npu.attention.backends.gqa.AscendAttentionBackend"


def test_checked_arguments_accept_common_values() -> None:
    import torch

    for dtype in (torch.float16, torch.bfloat16, torch.float32, "bfloat16", "half"):
        for block_size in (16, 128):
            assert (
                select_backend(use_mla=False, use_sparse=False, head_size=128, dtype=dtype, block_size=block_size)
                == GQA_BACKEND
            )
    assert select_backend(use_mla=False, use_sparse=False, kv_cache_dtype="auto") == GQA_BACKEND


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"use_mla": False, "use_sparse": False, "has_sink": True}, "sinks"),
        ({"use_mla": False, "use_sparse": True}, "without MLA"),
        ({"use_mla": False, "use_sparse": False, "head_size": 0}, "head_size"),
        ({"use_mla": False, "use_sparse": False, "dtype": "float8_e4m3fn"}, "--dtype"),
        ({"use_mla": False, "use_sparse": False, "block_size": 24}, "--block-size"),
        ({"use_mla": False, "use_sparse": False, "block_size": 1024}, "--block-size"),
        ({"use_mla": False, "use_sparse": False, "kv_cache_dtype": "fp8"}, "--kv-cache-dtype"),
    ],
)
def test_unsupported_combinations_raise(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        select_backend(**kwargs)


def test_import_is_light() -> None:
    assert_import_light("import vllm_npu.attention.selector as s", "s.select_backend(use_mla=False, use_sparse=False)")


def test_package_door_is_light_and_exports_the_gqa_backend() -> None:
    assert_import_light("import vllm_npu.attention", forbid=("torch", "vllm"))
    import vllm_npu.attention as a  # resolving the backend imports torch and vLLM: here, not in the light child

    assert a.AscendAttentionBackend.__module__ == "vllm_npu.attention.backends.gqa"
    assert a.GQA_BACKEND.endswith(a.AscendAttentionBackend.__qualname__)
