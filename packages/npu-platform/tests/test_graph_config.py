# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Graph mode resolution (vllm_npu.platform.graphs.config) and the stream-limit cap on capture sizes (.sizes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CompilationLevel, CUDAGraphMode
from vllm.config.compilation import CompilationConfig
from vllm_npu.interface import ConfigError
from vllm_npu.platform.graphs.config import configure_graphs
from vllm_npu.platform.graphs.sizes import StreamBudget, max_capture_sizes, thin_sizes


def config(
    mode=None,
    sizes=(1, 2, 4, 8),
    *,
    enforce_eager=False,
    layers=2,
    tp=1,
    dp=1,
    ep=False,
    experts=0,
    draft_layers=None,
    method="eagle",
    npu=None,
    max_tokens=256,
    lora=False,
    max_seqs=16,
    graph_sizes=(32,),
    sleep=False,
):
    comp = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes))
    spec = None
    if draft_layers is not None:
        draft = SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=draft_layers))
        spec = SimpleNamespace(draft_model_config=draft, use_eagle=lambda: method in ("eagle", "eagle3", "mtp"))
    return SimpleNamespace(
        compilation_config=comp,
        lora_config=SimpleNamespace(max_loras=2) if lora else None,
        model_config=SimpleNamespace(
            enforce_eager=enforce_eager,
            enable_sleep_mode=sleep,
            get_num_layers=lambda parallel: layers,
            hf_text_config=SimpleNamespace(num_experts=experts),
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, cuda_graph_sizes=list(graph_sizes)
        ),
        speculative_config=spec,
        additional_config={"npu": npu} if npu else {},
    )


#: vLLM 0.11's default capture sizes (max_num_seqs 256: up to 512 tokens), 67 of them.
VLLM_SIZES = [1, 2, 4, *range(8, 513, 8)]


@pytest.mark.parametrize(
    ("mode", "emulated", "expected", "level"),
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, False, "PIECEWISE", CompilationLevel.PIECEWISE),  # vLLM's default
        # The emulated device compiles by default (issue 35): FULL_DECODE_ONLY, the model itself not Dynamo-compiled.
        (CUDAGraphMode.FULL_AND_PIECEWISE, True, "FULL_DECODE_ONLY", CompilationLevel.NO_COMPILATION),
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


@pytest.mark.parametrize(
    ("layers", "tp", "dp", "expected"),
    [
        # floor((1800 - 40 g) / (L + 1) / (1 + 2 g)): vllm-ascend v0.11.0's update_aclgraph_sizes, default HCCL mode
        (48, 4, 1, 11),  # 1760 // (49 * 3); the old 1800 / ((L + 1)(1 + g)) allowed 18
        (32, 2, 1, 17),  # 1760 // (33 * 3)
        (61, 8, 1, 9),  # 1760 // (62 * 3)
        (48, 2, 2, 7),  # 1720 // (49 * 5)
        (48, 1, 1, 36),  # no communication group: 1800 // 49
    ],
)
def test_stream_budget_under_the_default_hccl_expansion(monkeypatch, layers, tp, dp, expected):
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    cfg = config(CUDAGraphMode.PIECEWISE, VLLM_SIZES, layers=layers, tp=tp, dp=dp, max_tokens=1024)
    plan = configure_graphs(cfg, "auto", False)
    assert len(plan.capture_sizes) == expected
    assert plan.capture_sizes[0] == 1 and plan.capture_sizes[-1] == max(VLLM_SIZES)  # both ends kept
    assert max_capture_sizes(layers + 1, int(tp > 1) + int(dp > 1)) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # floor(budget / (L + 1) / f), f = 1 + g + EP + overlap (+ DP > 1 for MoE); dense: budget = 1800 - f (L + 1)
        ({"tp": 4}, 17),  # dense, f = 2: (1800 - 98) // 98
        ({"tp": 4, "ep": True, "experts": 8}, 12),  # MoE, f = 3: 1800 // 147
        ({"tp": 4, "ep": True, "experts": 8, "npu": {"multistream_overlap_shared_expert": True}}, 9),  # f = 4
        ({"dp": 2, "ep": True, "experts": 8}, 9),  # MoE over DP: f = 1 + 1 + 1 + 1 = 4: 1800 // 196
        ({"dp": 2, "experts": 8}, 12),  # MoE without EP, f = 3
    ],
)
def test_stream_budget_under_aiv_expansion(monkeypatch, kwargs, expected):
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    cfg = config(CUDAGraphMode.PIECEWISE, VLLM_SIZES, layers=48, max_tokens=1024, **kwargs)
    assert len(configure_graphs(cfg, "auto", False).capture_sizes) == expected


def test_aiv_expansion_counts_expert_parallel_and_overlap_only_there(monkeypatch):
    # Under the default expansion, vllm-ascend counts neither EP nor the shared-expert stream.
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    overlap = {"multistream_overlap_shared_expert": True}
    cfg = config(CUDAGraphMode.PIECEWISE, VLLM_SIZES, layers=48, tp=4, ep=True, experts=8, npu=overlap, max_tokens=1024)
    assert len(configure_graphs(cfg, "auto", False).capture_sizes) == 11


@pytest.mark.parametrize(
    ("method", "draft_layers", "expected"),
    [
        ("eagle", 1, 16),  # (33 + 1 + 1) graphs per size: 1760 // (35 * 3)
        ("mtp", 61, 4),  # DeepSeek MTP: vLLM keeps the target's 61 layers in the draft config; 1760 // (124 * 3)
        ("ngram", 32, 17),  # no draft model is captured
    ],
)
def test_stream_budget_counts_the_draft_model(monkeypatch, method, draft_layers, expected):
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    layers, tp = (61, 8) if method == "mtp" else (32, 2)
    cfg = config(
        CUDAGraphMode.PIECEWISE,
        VLLM_SIZES,
        layers=layers,
        tp=tp,
        draft_layers=draft_layers,
        method=method,
        max_tokens=1024,
    )
    assert len(configure_graphs(cfg, "auto", False).capture_sizes) == expected


def test_full_decode_only_counts_one_graph_per_size(monkeypatch):
    # One graph per size (the draft runs eagerly): the limit is 1760 // 3 = 586, far above any size list.
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    cfg = config(CUDAGraphMode.FULL_DECODE_ONLY, VLLM_SIZES, layers=80, tp=2, draft_layers=1, max_tokens=1024)
    assert len(configure_graphs(cfg, "auto", False).capture_sizes) == len(VLLM_SIZES)
    assert StreamBudget(1, 1).max_sizes == 586


def test_stream_budget_is_logged_with_the_mode_and_the_aiv_hint(monkeypatch):
    from vllm_npu.platform.graphs import config as graph_config

    lines: list[str] = []
    monkeypatch.setattr(graph_config.logger, "info", lambda msg, *args: lines.append(msg % args))
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    configure_graphs(config(CUDAGraphMode.PIECEWISE, VLLM_SIZES, layers=48, tp=4, max_tokens=1024), "auto", False)
    budget = next(line for line in lines if "stream budget (PIECEWISE)" in line)
    assert "HCCL_OP_EXPANSION_MODE=unset (FFTS+/AICPU expansion)" in budget and "at most 11 capture sizes" in budget
    assert "HCCL_OP_EXPANSION_MODE=AIV leaves more streams" in budget
    assert any(line.endswith("(the stream budget)") and "-> [1, " in line for line in lines)  # the thinning
    lines.clear()
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    configure_graphs(config(CUDAGraphMode.PIECEWISE, VLLM_SIZES, layers=48, tp=4, max_tokens=1024), "auto", False)
    budget = next(line for line in lines if "stream budget" in line)
    assert "HCCL_OP_EXPANSION_MODE=AIV: 49 graphs per size" in budget and "parallel factor 2" in budget
    assert "at most 17 capture sizes" in budget and "leaves more streams" not in budget


def test_thin_sizes_keeps_ends_and_spreads():
    assert thin_sizes([8, 1, 4, 2], 10) == [1, 2, 4, 8]
    assert thin_sizes(list(range(1, 101)), 5) == [1, 26, 51, 75, 100]
    assert thin_sizes([3, 9], 1) == [9]


def test_every_npu_graph_mode_setting_has_a_plan():
    from vllm_npu.interface import GRAPH_MODES as SETTINGS
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


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY])
@pytest.mark.parametrize("emulated", [False, True])
def test_blocking_launch_with_acl_graphs_is_refused_by_name(monkeypatch, mode, emulated):
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    with pytest.raises(ConfigError, match="ASCEND_LAUNCH_BLOCKING=1 is set, and ACL graphs cannot be captured") as err:
        configure_graphs(config(mode), "auto", emulated)
    assert "Unset ASCEND_LAUNCH_BLOCKING" in str(err.value) and "--enforce-eager or npu.graph_mode='eager'" in str(
        err.value
    )


def test_blocking_launch_is_fine_without_acl_graphs(monkeypatch):
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    assert configure_graphs(config(CUDAGraphMode.NONE), "auto", False).mode == "NONE"
    assert configure_graphs(config(CUDAGraphMode.PIECEWISE, enforce_eager=True), "auto", False).mode == "NONE"
    # torchair compiles GE graphs, no ACL graph capture (vllm-ascend's check does not cover it either)
    assert configure_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE), "torchair", True).mode == "FULL_DECODE_ONLY"
    monkeypatch.setenv("ASCEND_LAUNCH_BLOCKING", "0")
    assert configure_graphs(config(CUDAGraphMode.PIECEWISE), "auto", False).mode == "PIECEWISE"


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY])
def test_graph_modes_warm_each_size_up_eagerly_before_capturing_it(mode):
    # CompilationConfig's own default is 0 warm-ups (vLLM's VllmConfig raises it to 1 only on its V1 path).
    cfg = config(mode)
    assert cfg.compilation_config.cudagraph_num_of_warmups == 0
    configure_graphs(cfg, "auto", False)
    assert cfg.compilation_config.cudagraph_num_of_warmups == 1
    cfg = config(mode)
    cfg.compilation_config.cudagraph_num_of_warmups = 3  # a user's larger count stays
    configure_graphs(cfg, "auto", False)
    assert cfg.compilation_config.cudagraph_num_of_warmups == 3


# --- the emulated device (issue 35): compiled FULL_DECODE_ONLY by default, as vLLM compiles by default -------------

INDUCTOR = {"emulated_compile": "inductor"}


def test_emulated_default_is_compiled_full_decode_only_and_names_the_way_out():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16)
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile, plan.capture_sizes) == ("FULL_DECODE_ONLY", "inductor", (1, 2, 4, 8, 16))
    assert "--enforce-eager" in plan.reason and "npu.emulated_compile='none'" in plan.reason
    # The workers' graph wrappers read the resolved value ("auto" -> "inductor") from additional_config.
    assert cfg.additional_config == {"npu": {"emulated_compile": "inductor"}}
    assert not cfg.model_config.enforce_eager


def test_emulated_compile_none_keeps_the_default_eager():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16, npu={"emulated_compile": "none"})
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile, plan.capture_sizes) == ("NONE", "none", ())
    assert "npu.emulated_compile=none" in plan.reason and cfg.model_config.enforce_eager


#: vLLM 0.11's default capture sizes for max_num_seqs 16 (cuda_graph_sizes [32], up to 256 tokens).
VLLM_SIZES_16 = [1, 2, 4, 8, 16, 24, 32]


def test_emulated_compile_alone_is_compiled_full_decode_only_at_a_few_sizes():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16, npu=dict(INDUCTOR))
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile, plan.capture_sizes) == ("FULL_DECODE_ONLY", "inductor", (1, 2, 4, 8, 16))
    assert "compiled replay" in plan.reason and "capture sizes [1, 2, 4, 8, 16]" in plan.reason
    # The workers' graph wrappers read the resolved value from additional_config.
    assert cfg.additional_config == {"npu": {"emulated_compile": "inductor"}}
    assert cfg.compilation_config.max_capture_size == 16 and not cfg.model_config.enforce_eager


def test_emulated_default_sizes_stop_at_max_num_seqs():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8], max_seqs=4, graph_sizes=(8,), npu=dict(INDUCTOR))
    assert configure_graphs(cfg, "auto", True).capture_sizes == (1, 2, 4)


def test_emulated_default_keeps_the_users_capture_sizes():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 3], npu=dict(INDUCTOR))  # not vLLM's list: the user's own
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile, plan.capture_sizes) == ("FULL_DECODE_ONLY", "inductor", (1, 3))


@pytest.mark.parametrize(
    ("kwargs", "graph_mode", "npu", "mode", "compile_mode"),
    [
        ({"enforce_eager": True}, "auto", None, "NONE", "none"),
        ({}, "eager", None, "NONE", "none"),
        ({}, "auto", None, "FULL_DECODE_ONLY", "inductor"),  # the default
        ({}, "auto", {"emulated_compile": "none"}, "NONE", "none"),
        ({}, "auto", {"emulated_compile": "inductor"}, "FULL_DECODE_ONLY", "inductor"),
        ({}, "piecewise", None, "PIECEWISE", "none"),  # an explicit graph mode keeps uncompiled replay
        ({}, "full_decode_only", {"emulated_compile": "inductor"}, "FULL_DECODE_ONLY", "inductor"),
        ({"lora": True}, "auto", None, "NONE", "none"),
    ],
)
def test_emulated_default_yields_to_explicit_settings(kwargs, graph_mode, npu, mode, compile_mode):
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16, npu=npu, **kwargs)
    plan = configure_graphs(cfg, graph_mode, True)
    assert (plan.mode, plan.compile) == (mode, compile_mode)
    assert cfg.additional_config["npu"]["emulated_compile"] == compile_mode
    if mode == "PIECEWISE":
        assert plan.capture_sizes == tuple(VLLM_SIZES_16)  # explicit modes keep vLLM's list


def test_explicit_cudagraph_mode_on_the_emulated_device_is_not_compiled():
    cfg = config(CUDAGraphMode.FULL_DECODE_ONLY)
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile) == ("FULL_DECODE_ONLY", "none")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"draft_layers": 1}, "speculative decoding"),
        ({"tp": 2}, "tensor parallel 2"),
        ({"dp": 2}, "data parallel 2"),
        ({"sleep": True}, "sleep mode"),
        ({"pooling": True}, "a pooling model"),
    ],
)
@pytest.mark.parametrize("npu", [None, INDUCTOR])  # the default ("auto") and the explicit opt-in
def test_emulated_default_falls_back_to_eager_naming_the_feature(kwargs, named, npu):
    kwargs = dict(kwargs)  # the parametrized dict is shared by both values of npu
    pooling = kwargs.pop("pooling", False)
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16, npu=dict(npu or {}), **kwargs)
    cfg.model_config.runner_type = "pooling" if pooling else "generate"
    plan = configure_graphs(cfg, "auto", True)
    assert (plan.mode, plan.compile) == ("NONE", "none") and named in plan.reason


def test_npu_default_is_unchanged_and_leaves_additional_config_alone():
    cfg = config(CUDAGraphMode.FULL_AND_PIECEWISE, VLLM_SIZES_16)
    plan = configure_graphs(cfg, "auto", False)
    assert (plan.mode, plan.compile, plan.capture_sizes) == ("PIECEWISE", "none", tuple(VLLM_SIZES_16))
    assert cfg.additional_config == {}
