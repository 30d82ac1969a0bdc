# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Graph mode resolution (vllm_npu.platform.graphs.config) and the stream-limit cap on capture sizes (.sizes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CompilationLevel, CUDAGraphMode
from vllm.config.compilation import CompilationConfig
from vllm_npu.interface.errors import ConfigError
from vllm_npu.platform.graphs.config import configure_graphs
from vllm_npu.platform.graphs.sizes import GRAPH_STREAM_BUDGET, max_capture_sizes, thin_sizes


def config(mode=None, sizes=(1, 2, 4, 8), *, enforce_eager=False, layers=2, tp=1, max_tokens=256, lora=False):
    comp = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes))
    return SimpleNamespace(
        compilation_config=comp,
        lora_config=SimpleNamespace(max_loras=2) if lora else None,
        model_config=SimpleNamespace(enforce_eager=enforce_eager, get_num_layers=lambda parallel: layers),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1, enable_expert_parallel=False),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
    )


@pytest.mark.parametrize(
    ("mode", "emulated", "expected", "level"),
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, False, "PIECEWISE", CompilationLevel.PIECEWISE),  # vLLM's default
        (CUDAGraphMode.FULL_AND_PIECEWISE, True, "NONE", CompilationLevel.NO_COMPILATION),  # opt-in when emulated
        (CUDAGraphMode.PIECEWISE, True, "PIECEWISE", CompilationLevel.PIECEWISE),
        (CUDAGraphMode.FULL_DECODE_ONLY, True, "FULL_DECODE_ONLY", CompilationLevel.NO_COMPILATION),
        (CUDAGraphMode.NONE, False, "NONE", CompilationLevel.NO_COMPILATION),
    ],
)
def test_vllm_cudagraph_mode_decides(mode, emulated, expected, level):
    cfg = config(mode)
    plan = configure_graphs(cfg, "auto", emulated)
    comp = cfg.compilation_config
    assert plan.mode == expected and comp.cudagraph_mode == CUDAGraphMode[expected] and comp.level == level
    if expected == "NONE":
        assert comp.cudagraph_capture_sizes == [] and cfg.model_config.enforce_eager
    else:
        assert comp.cudagraph_capture_sizes == [8, 4, 2, 1] and comp.max_capture_size == 8
        assert cfg.compilation_config.bs_to_padded_graph_size[3] == 4  # padding to the next capture size
    if expected == "PIECEWISE":
        assert not comp.use_inductor and "vllm.unified_attention_with_output" in comp.splitting_ops


@pytest.mark.parametrize(
    ("graph_mode", "expected"),
    [("piecewise", "PIECEWISE"), ("full_decode_only", "FULL_DECODE_ONLY"), ("eager", "NONE")],
)
def test_npu_graph_mode_sets_the_mode(graph_mode, expected):
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert configure_graphs(cfg, graph_mode, True).mode == expected


def test_lora_turns_the_default_graphs_off():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, lora=True)
    plan = configure_graphs(cfg, "auto", False)  # on an NPU the default would be PIECEWISE
    assert plan.mode == "NONE" and "LoRA" in plan.reason
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE and cfg.model_config.enforce_eager


@pytest.mark.parametrize(
    ("mode", "graph_mode", "key"),
    [
        (CUDAGraphMode.PIECEWISE, "auto", "compilation_config.cudagraph_mode=PIECEWISE"),
        (CUDAGraphMode.FULL_DECODE_ONLY, "auto", "compilation_config.cudagraph_mode=FULL_DECODE_ONLY"),
        (CUDAGraphMode.FULL_AND_PIECEWISE, "full_decode_only", "npu.graph_mode='full_decode_only'"),
    ],
)
def test_lora_with_an_explicit_graph_mode_is_refused_naming_the_key(mode, graph_mode, key):
    with pytest.raises(ConfigError, match="conflicts with LoRA") as err:
        configure_graphs(config(mode, lora=True), graph_mode, True)
    assert key in str(err.value) and "npu.graph_mode to 'eager'" in str(err.value)


def test_full_graphs_of_mixed_batches_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"compilation_config.cudagraph_mode=FULL is not supported.*FULL_DECODE_ONLY"):
        configure_graphs(config(CUDAGraphMode.FULL), "auto", False)


def test_conflicting_graph_mode_and_cudagraph_mode_are_refused():
    with pytest.raises(
        ConfigError, match="npu.graph_mode='piecewise' conflicts with compilation_config.cudagraph_mode"
    ):
        configure_graphs(config(CUDAGraphMode.FULL_DECODE_ONLY), "piecewise", False)


def test_enforce_eager_with_a_graph_mode_is_refused():
    with pytest.raises(ConfigError, match="npu.graph_mode='full_decode_only' conflicts with enforce_eager"):
        configure_graphs(config(CUDAGraphMode.NONE, enforce_eager=True), "full_decode_only", False)
    assert configure_graphs(config(CUDAGraphMode.NONE, enforce_eager=True), "auto", False).mode == "NONE"


@pytest.mark.parametrize("bad", [[0, 4], [1, 512], [-2]])
def test_bad_capture_sizes_are_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"compilation_config.cudagraph_capture_sizes holds \["):
        configure_graphs(config(CUDAGraphMode.PIECEWISE, bad, max_tokens=256), "auto", False)


def test_stream_limit_caps_the_number_of_capture_sizes():
    # 80 layers -> 81 piecewise graphs per size; TP adds one stream per graph: 1800 // (81 * 2) = 11 sizes.
    assert max_capture_sizes(81, 1) == GRAPH_STREAM_BUDGET // 162 == 11
    assert max_capture_sizes(1, 0) == GRAPH_STREAM_BUDGET  # one full graph per size
    sizes = [1, 2, 4, *range(8, 513, 8)]
    cfg = config(CUDAGraphMode.PIECEWISE, sizes, layers=80, tp=2, max_tokens=1024)
    plan = configure_graphs(cfg, "auto", False)
    assert len(plan.capture_sizes) == 11 and plan.capture_sizes[0] == 1 and plan.capture_sizes[-1] == 512
    # FULL_DECODE_ONLY makes one graph per size: nothing to thin.
    cfg = config(CUDAGraphMode.FULL_DECODE_ONLY, sizes, layers=80, tp=2, max_tokens=1024)
    assert len(configure_graphs(cfg, "auto", False).capture_sizes) == len(sizes)


def test_thin_sizes_keeps_ends_and_spreads():
    assert thin_sizes([8, 1, 4, 2], 10) == [1, 2, 4, 8]
    assert thin_sizes(list(range(1, 101)), 5) == [1, 26, 51, 75, 100]
    assert thin_sizes([3, 9], 1) == [9]


def test_every_npu_graph_mode_setting_has_a_plan():
    from vllm_npu.interface.settings import GRAPH_MODES as SETTINGS
    from vllm_npu.platform.graphs.config import GRAPH_MODES

    assert set(GRAPH_MODES) == set(SETTINGS)


def test_platform_names_our_wrapper_and_the_device_graph_pool():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.utils import resolve_obj_by_qualname
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper
    from vllm_npu.platform.platform import EmulatedNPUPlatform, NPUPlatform

    for platform in (NPUPlatform, EmulatedNPUPlatform):
        assert platform.support_static_graph_mode()
        wrapper = resolve_obj_by_qualname(platform.get_static_graph_wrapper_cls())  # how vLLM resolves it
        assert wrapper is NPUGraphWrapper and issubclass(wrapper, CUDAGraphWrapper)
    # the twin has no device pool; the NPU's is torch.npu.graph_pool_handle() (tests/contract)
    assert EmulatedNPUPlatform.device_backend.graph_pool_handle() is None
