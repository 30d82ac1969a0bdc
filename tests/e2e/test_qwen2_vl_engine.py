# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, tiny Qwen2-VL through vLLM's own model class, float32: images of two sizes, a
video and text in one batch, chunked prefill and prefix caching on (cases: ``qwen_vl_cases``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.vl_models import build_tiny_vl_model, tiny_vl_config

pytestmark = pytest.mark.engine

_HERE = Path(__file__).parent


def _load(name: str):
    """Import a helper module of this folder under its own name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


cases = _load("qwen_vl_cases")


@pytest.fixture(scope="module")
def architecture():
    return "Qwen2VLForConditionalGeneration"


@pytest.fixture(scope="module")
def vl_model():
    return build_tiny_vl_model(tiny_vl_config("qwen2_vl"))


@pytest.fixture(scope="module")
def llm(vl_model, tmp_path_factory):
    with engine(vl_model, emulated_env(tmp_path_factory.mktemp("qwen2_vl")), **cases.ENGINE_ARGS) as llm:
        yield llm


test_vllm_model_class_on_our_platform = cases.test_vllm_model_class_on_our_platform
test_images_video_and_text_in_one_batch_match_hf = cases.test_images_video_and_text_in_one_batch_match_hf
test_prefix_cache_hits_only_for_the_same_image = cases.test_prefix_cache_hits_only_for_the_same_image
