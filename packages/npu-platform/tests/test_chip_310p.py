# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The Ascend 310P: chip detection (soc codes, device names, the emulated chip) and the config-time refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CompilationConfig, CUDAGraphMode
from vllm_npu.interface import (
    ConfigError,
    EnvConfig,
    chip_of_device_name,
    chip_of_soc_version,
    current_chip,
    is_310p,
    read_emulated_soc,
    reset_chip,
)
from vllm_npu.platform import _device
from vllm_npu.platform._device import EmulatedDevice, NPUDevice
from vllm_npu.platform.platform import EmulatedNPUPlatform


@pytest.fixture
def soc_310p(monkeypatch):
    """The emulated device standing for an Ascend 310P (this process's device mode is emulated: conftest)."""
    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "310P")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    reset_chip()
    yield monkeypatch
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC")
    reset_chip()


def config_310p(
    *,
    dtype=torch.float16,
    use_mla=False,
    additional_config=None,
    cache_dtype="auto",
    model="m",
    kv_transfer=False,
    parallel=None,
    **comp,
):
    """The parts of VllmConfig the platform hook reads on a 310P (real CompilationConfig)."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(worker_cls="auto", disable_custom_all_reduce=False, **(parallel or {})),
        cache_config=SimpleNamespace(block_size=None, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(
            enforce_eager=False,
            disable_cascade_attn=False,
            hf_config=SimpleNamespace(),
            model=model,
            quantization=None,
            dtype=dtype,
            use_mla=use_mla,
        ),
        compilation_config=CompilationConfig(**comp),
        additional_config=additional_config or {},
        kv_transfer_config=SimpleNamespace(kv_connector="MooncakeConnectorV1") if kv_transfer else None,
    )


def test_soc_version_codes_follow_torch_npus_soc_enum():
    # torch_npu 2.8.0 NpuVariables.h: Ascend310P1 = 200 .. Ascend310P7 (205), 910B1 = 220 .. 910B4_1 (225),
    # 910_9391 = 250 .. 910_9362 (255); 310B (240-243) and 910A (100-104) are none of ours.
    assert [chip_of_soc_version(c) for c in (199, 200, 202, 205, 206)] == ["", "310P", "310P", "310P", ""]
    assert [chip_of_soc_version(c) for c in (220, 225, 240, 250, 255, 102)] == ["A2", "A2", "", "A3", "A3", ""]
    names = ("Ascend310P3", "Ascend910B2", "Ascend910_9391", "Ascend910A", "Ascend310B1")
    assert [chip_of_device_name(n) for n in names] == ["310P", "A2", "A3", "", ""]


def test_npu_device_reads_the_310p_soc_code(monkeypatch):
    monkeypatch.setattr(_device, "_torch_npu", lambda: SimpleNamespace(get_soc_version=lambda: 202))
    assert NPUDevice.soc() == "310P"
    monkeypatch.setattr(_device, "_torch_npu", lambda: SimpleNamespace(get_soc_version=lambda: 223))
    assert NPUDevice.soc() == "A2"


def test_emulated_soc_setting_is_validated():
    assert read_emulated_soc({}) == "none" and read_emulated_soc({"VLLM_NPU_EMULATED_SOC": " 310p "}) == "310P"
    assert EnvConfig.from_environ({"VLLM_NPU_EMULATED_SOC": "310p"}).EMULATED_SOC == "310P"
    with pytest.raises(ConfigError, match=r"VLLM_NPU_EMULATED_SOC='A5' is invalid; allowed: 'none', '310P'"):
        EnvConfig.from_environ({"VLLM_NPU_EMULATED_SOC": "A5"})


def test_the_emulated_device_reports_the_emulated_chip(soc_310p):
    assert current_chip() == "310P" and is_310p()
    assert EmulatedDevice.soc() == "310P" and "310P" in EmulatedDevice.device_name()
    soc_310p.setenv("VLLM_NPU_EMULATED_SOC", "none")
    reset_chip()
    assert not is_310p() and EmulatedDevice.soc() == "" and EmulatedDevice.device_name() == "emulated NPU (CPU)"


def test_310p_config_is_float16_and_eager(soc_310p):
    cfg = config_310p()
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert cfg.model_config.enforce_eager and cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    platform = EmulatedNPUPlatform()
    assert platform.supported_dtypes == [torch.float16]  # --dtype auto of a bf16 checkpoint: float16
    platform.check_if_supports_dtype(torch.float16)
    with pytest.raises(ValueError, match="float16 only, not torch.bfloat16"):
        platform.check_if_supports_dtype(torch.bfloat16)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            config_310p(dtype=torch.bfloat16),
            r"the Atlas 300I \(Ascend 310P\) serves models in float16 only, not torch.bfloat16 \(the chip has no "
            r"bfloat16 arithmetic; .*\); pass --dtype float16",
        ),
        (config_310p(dtype=torch.float32), r"float16 only, not torch.float32 .*pass --dtype float16"),
        (
            config_310p(additional_config={"npu": {"graph_mode": "piecewise"}}),
            r"npu.graph_mode='piecewise' is not supported on the Atlas 300I \(Ascend 310P\): it runs eagerly only",
        ),
        (config_310p(additional_config={"npu": {"graph_mode": "torchair"}}), r"npu.graph_mode='torchair' is not"),
        (
            config_310p(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY),
            r"compilation_config.cudagraph_mode=FULL_DECODE_ONLY is not supported on the Atlas 300I",
        ),
        (config_310p(use_mla=True), r"multi-head latent attention \(MLA/SFA.* is not supported on the Atlas 300I"),
        (
            config_310p(additional_config={"npu": {"moe_mc2": "on"}}),
            r"npu.moe_mc2='on' is not supported on the Atlas 300I .*set npu.moe_mc2 to 'auto' or 'off'",
        ),
        (config_310p(cache_dtype="int8"), r"kv_cache_dtype='int8' is not supported on the Atlas 300I"),
        (config_310p(kv_transfer=True), r"KV transfer \(--kv-transfer-config.* is not supported on the Atlas 300I"),
        (
            config_310p(parallel={"enable_eplb": True}),
            r"--enable-eplb is not supported on the Atlas 300I .*int64 .*patch_distributed.py\); serve without EPLB",
        ),
        (
            config_310p(parallel={"pipeline_parallel_size": 2, "distributed_executor_backend": "external_launcher"}),
            r"pipeline parallelism under the external_launcher executor is not supported .*broadcast",
        ),
    ],
    ids=[
        "bf16",
        "fp32",
        "piecewise",
        "torchair",
        "cudagraph_mode",
        "mla",
        "mc2",
        "kv_int8",
        "kv_connector",
        "eplb",
        "pp_external_launcher",
    ],
)
def test_310p_refusals_name_the_feature_and_the_fix(soc_310p, cfg, message):
    with pytest.raises(ConfigError, match=message):
        EmulatedNPUPlatform.check_and_update_config(cfg)


def _quantized(tmp_path, description):
    (tmp_path / "quant_model_description.json").write_text(json.dumps(description))
    cfg = config_310p(model=str(tmp_path))
    cfg.model_config.quantization = "ascend"
    return cfg


@pytest.mark.parametrize(
    ("qtype", "why"),
    [
        ("W8A8_DYNAMIC", "npu_dynamic_quant for A2/A3 only and npu_quant_matmul without pertoken_scale on this chip"),
        ("W4A8_DYNAMIC", "int4 grouped matmuls are documented for A2/A3 only"),
    ],
)
def test_310p_refuses_dynamic_quant_checkpoints_by_scheme(soc_310p, tmp_path, qtype, why):
    cfg = _quantized(tmp_path, {"model_quant_type": qtype, "model.layers.0.mlp.down_proj.weight": qtype})
    with pytest.raises(ConfigError, match=rf"uses {qtype}, which is not supported on the Atlas 300I.*{why}"):
        EmulatedNPUPlatform.check_and_update_config(cfg)


def test_310p_takes_tensor_and_expert_parallel(soc_310p):
    cfg = config_310p(
        parallel={"tensor_parallel_size": 2, "enable_expert_parallel": True, "distributed_executor_backend": "mp"}
    )
    EmulatedNPUPlatform.check_and_update_config(cfg)  # float16 MoE with TP + EP runs on the 310P paths


def test_310p_takes_static_w8a8_linears_and_refuses_w8a8_experts(soc_310p, tmp_path):
    dense = _quantized(tmp_path, {"model_quant_type": "W8A8", "model.layers.0.mlp.down_proj.weight": "W8A8"})
    EmulatedNPUPlatform.check_and_update_config(dense)
    moe = tmp_path / "moe"
    moe.mkdir()
    cfg = _quantized(moe, {"model_quant_type": "W8A8", "model.layers.0.mlp.experts.0.down_proj.weight": "W8A8"})
    with pytest.raises(ConfigError, match=r"has W8A8 MoE experts, which are not supported on the Atlas 300I"):
        EmulatedNPUPlatform.check_and_update_config(cfg)


def test_other_chips_are_not_gated(monkeypatch):
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC", raising=False)
    reset_chip()
    cfg = config_310p(dtype=torch.bfloat16, additional_config={"npu": {"graph_mode": "piecewise"}})
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert torch.bfloat16 in EmulatedNPUPlatform().supported_dtypes
