# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUPlatform / EmulatedNPUPlatform: device facts, the config hook, attention selection, errors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from npu_testkit.import_light import assert_import_light
from vllm.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from vllm_npu.interface import (
    ComponentSkewError,
    ConfigError,
    DeviceUnavailableError,
    MissingComponentError,
    reset_device_selection,
)
from vllm_npu.platform.platform import EmulatedNPUPlatform, NPUPlatform


def fake_vllm_config(
    *, block_size=None, enforce_eager=False, additional_config=None, custom_ops=None, cache_dtype="auto", hf_config=None
):
    """The parts of VllmConfig the platform hook reads and writes (real CompilationConfig)."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(worker_cls="auto", disable_custom_all_reduce=False),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(
            enforce_eager=enforce_eager,
            disable_cascade_attn=False,
            hf_config=hf_config or SimpleNamespace(),
            model="unused-model-dir",
            quantization=None,
        ),
        compilation_config=CompilationConfig(custom_ops=list(custom_ops or [])),
        additional_config=additional_config or {},
        kv_transfer_config=None,
    )


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    return monkeypatch


def test_one_hierarchy_only_device_facts_differ():
    assert issubclass(EmulatedNPUPlatform, NPUPlatform)
    npu = (NPUPlatform.device_name, NPUPlatform.device_type, NPUPlatform.dispatch_key, NPUPlatform.dist_backend)
    emu = (
        EmulatedNPUPlatform.device_name,
        EmulatedNPUPlatform.device_type,
        EmulatedNPUPlatform.dispatch_key,
        EmulatedNPUPlatform.dist_backend,
    )
    assert npu == ("npu", "npu", "PrivateUse1", "hccl")
    assert emu == ("cpu", "cpu", "CPU", "gloo")
    assert NPUPlatform.device_control_env_var == "ASCEND_RT_VISIBLE_DEVICES" and NPUPlatform.ray_device_key == "NPU"
    assert EmulatedNPUPlatform.simple_compile_backend == "eager"
    assert NPUPlatform.is_out_of_tree and EmulatedNPUPlatform._enum == NPUPlatform._enum
    # Every hook is NPUPlatform's: the emulated class overrides no method.
    overridden = [
        k
        for k, v in vars(EmulatedNPUPlatform).items()
        if isinstance(v, (classmethod, staticmethod, property)) or (callable(v) and not isinstance(v, type))
    ]
    assert overridden == []
    assert NPUPlatform.is_pin_memory_available() and not EmulatedNPUPlatform.is_pin_memory_available()
    assert EmulatedNPUPlatform.is_sleep_mode_available()
    assert NPUPlatform.supported_quantization == ["ascend"]


def test_vit_attention_backend_is_torch_sdpa_for_every_head_size_and_dtype():
    from vllm.model_executor.models.vision import get_vit_attn_backend
    from vllm.platforms import _Backend

    for cls in (NPUPlatform, EmulatedNPUPlatform):
        for head_size, dtype in ((80, torch.bfloat16), (72, torch.float16), (16, torch.float32)):
            assert cls.get_vit_attn_backend(head_size, dtype) is _Backend.TORCH_SDPA
    # vLLM's towers ask through vision.get_vit_attn_backend, which reaches the active (emulated) platform.
    assert get_vit_attn_backend(head_size=80, dtype=torch.float32) is _Backend.TORCH_SDPA


def test_torch_npu_is_never_imported_by_the_emulated_path():
    assert_import_light(
        "import os; os.environ['VLLM_NPU_DEVICE']='emulated'",
        "from vllm_npu.platform.platform import EmulatedNPUPlatform",
        "p = EmulatedNPUPlatform(); p.mem_get_info(); p.get_current_memory_usage(); p.synchronize()",
        "import vllm_npu.platform.worker, vllm_npu.platform.model_runner, vllm_npu.platform.communicator",
        forbid=("torch_npu",),
        timeout=600,
    )


def test_emulated_config_hook(env):
    # Eager: the default compiles and captures (test_graph_config.py); the rest of the hook is the same.
    cfg = fake_vllm_config(custom_ops=["-rms_norm", "+silu_and_mul"], enforce_eager=True)
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == "vllm_npu.platform.worker.NPUWorker"
    assert cfg.parallel_config.disable_custom_all_reduce and cfg.model_config.disable_cascade_attn
    assert cfg.cache_config.block_size == 16
    comp = cfg.compilation_config
    assert comp.level == CompilationLevel.NO_COMPILATION and cfg.model_config.enforce_eager
    assert comp.cudagraph_mode == CUDAGraphMode.NONE and comp.cudagraph_capture_sizes == [] and comp.compile_sizes == []
    assert comp.custom_ops == ["all", "-rms_norm"]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # fork hazard on the emulated device


@pytest.mark.parametrize("quant_available", [True, False])
def test_config_hook_lets_the_quant_layer_claim_a_description_only_checkpoint(env, quant_available):
    import vllm_npu.quant as quant

    claimed = []
    env.setattr("vllm_npu.interface.registry.is_available", lambda layer: quant_available if layer == "quant" else True)
    env.setattr(quant, "claim_checkpoint", claimed.append)  # the platform imports it through the quant door
    cfg = fake_vllm_config()
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert claimed == ([cfg] if quant_available else [])


def test_without_the_quant_layer_a_description_only_checkpoint_is_refused(env, tmp_path):
    from vllm_npu.interface import MissingComponentError

    env.setattr("vllm_npu.interface.registry.discover", lambda: {})  # nothing installed, as without npu-quant
    cfg = fake_vllm_config()
    cfg.model_config.model = str(tmp_path)
    EmulatedNPUPlatform.check_and_update_config(cfg)  # no description: a float checkpoint passes
    (tmp_path / "quant_model_description.json").write_text('{"model_quant_type": "W8A8", "a.weight": "W8A8"}')
    cfg = fake_vllm_config()
    cfg.model_config.model = str(tmp_path)
    with pytest.raises(MissingComponentError) as info:
        EmulatedNPUPlatform.check_and_update_config(cfg)
    assert str(info.value) == (
        f"the checkpoint {str(tmp_path)!r} is msModelSlim-quantized (quant_model_description.json; scheme W8A8) and "
        "needs the 'ascend' quantization method of the quant layer; install the quant layer: pip install "
        '"npu-platform[quant]"'
    )
    cfg.model_config.quantization = "fp8"  # a method the user chose explicitly is not second-guessed
    EmulatedNPUPlatform.check_and_update_config(cfg)


def test_the_quant_gate_claims_what_npu_quant_claims_and_refuses_with_the_path(monkeypatch, tmp_path):
    from vllm_npu.interface import MissingComponentError
    from vllm_npu.platform._quant_gate import MissingQuantLayerConfig
    from vllm_npu.quant import AscendQuantConfig

    for hf_cfg in ({"quant_method": "ascend"}, {"a.weight": "W8A8"}, {"quant_method": "awq"}, None):
        for user in (None, "ascend", "fp8"):
            assert MissingQuantLayerConfig.override_quantization_method(
                hf_cfg, user
            ) == AscendQuantConfig.override_quantization_method(hf_cfg, user), (hf_cfg, user)
    monkeypatch.setattr("vllm_npu.interface.registry.discover", lambda: {})
    gate = MissingQuantLayerConfig.from_config({"a.weight": "W8A8_DYNAMIC"})
    with pytest.raises(MissingComponentError, match=r"\(config.json quantization_config; scheme W8A8_DYNAMIC\)"):
        gate.maybe_update_config(str(tmp_path))
    with pytest.raises(MissingComponentError, match=r"^the checkpoint is msModelSlim-quantized \(--quantization"):
        MissingQuantLayerConfig().get_quant_method(None, "model.layers.0")


def test_emulated_hook_keeps_an_explicit_multiproc_method(env):
    env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    EmulatedNPUPlatform.check_and_update_config(fake_vllm_config())
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_npu_config_hook_defaults_to_piecewise_graphs_and_block_128(env):
    cfg = fake_vllm_config()
    NPUPlatform.check_and_update_config(cfg)
    comp = cfg.compilation_config
    assert cfg.cache_config.block_size == 128
    assert comp.level == CompilationLevel.PIECEWISE and not comp.use_inductor
    assert "vllm.unified_attention_with_output" in comp.splitting_ops
    assert comp.cudagraph_mode == CUDAGraphMode.PIECEWISE  # ACL graphs by default, as vllm-ascend
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # torch_npu's fork rule (test_runtime_rules.py)


def test_npu_config_hook_respects_enforce_eager_and_user_block_size(env):
    cfg = fake_vllm_config(enforce_eager=True, block_size=64)
    NPUPlatform.check_and_update_config(cfg)
    assert cfg.compilation_config.level == CompilationLevel.NO_COMPILATION
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.cache_config.block_size == 64


def test_deepseek_v32_fp8_ds_mla_cache_becomes_the_model_dtype(env):
    cfg = fake_vllm_config(cache_dtype="fp8_ds_mla", hf_config=SimpleNamespace(index_topk=2048))
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert cfg.cache_config.cache_dtype == "auto"
    other = fake_vllm_config(cache_dtype="fp8")  # not V3.2: left for the attention selector to refuse clearly
    EmulatedNPUPlatform.check_and_update_config(other)
    assert other.cache_config.cache_dtype == "fp8"


def test_piecewise_with_enforce_eager_is_a_config_error(env):
    cfg = fake_vllm_config(enforce_eager=True, additional_config={"npu": {"graph_mode": "piecewise"}})
    with pytest.raises(ConfigError, match="conflicts with enforce_eager"):
        NPUPlatform.check_and_update_config(cfg)


def test_config_hook_validates_additional_config_and_environment(env):
    with pytest.raises(ConfigError, match="npu.graph_mod is not a known key"):
        EmulatedNPUPlatform.check_and_update_config(fake_vllm_config(additional_config={"npu": {"graph_mod": "eager"}}))
    env.setenv("VLLM_NPU_EMULATED_KV_CACHE_GB", "lots")
    with pytest.raises(ConfigError, match="VLLM_NPU_EMULATED_KV_CACHE_GB='lots' is invalid"):
        EmulatedNPUPlatform.check_and_update_config(fake_vllm_config())


def test_config_hook_warns_about_vllm_ascend_settings_and_goes_on(env, monkeypatch):
    warned: list[str] = []
    monkeypatch.setattr("vllm_npu.platform.platform.logger.warning", lambda msg, *args: warned.append(msg % args))
    env.setenv("VLLM_ASCEND_ENABLE_MLAPO", "1")
    env.setenv("VLLM_ASCEND_NOT_A_REAL_ONE", "1")
    cfg = fake_vllm_config(
        additional_config={"torchair_graph_config": {"enabled": True}, "npu": {"graph_mode": "eager"}}
    )
    EmulatedNPUPlatform.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == "vllm_npu.platform.worker.NPUWorker"  # the hook ran to the end
    ascend = [w for w in warned if "vllm-ascend" in w]
    assert [w.split(" is ")[0] for w in ascend] == [
        "--additional-config torchair_graph_config={'enabled': True}",
        "environment VLLM_ASCEND_ENABLE_MLAPO='1'",
        "environment: VLLM_ASCEND_NOT_A_REAL_ONE",
    ]


def test_config_hook_refuses_vllm_ascend_settings_it_cannot_ignore(env):
    cfg = fake_vllm_config(additional_config={"oproj_tensor_parallel_size": 2})
    with pytest.raises(
        ConfigError, match=r"oproj_tensor_parallel_size=2 is a vllm-ascend setting .* cannot be ignored"
    ):
        EmulatedNPUPlatform.check_and_update_config(cfg)


def test_config_hook_refuses_a_skewed_component_set(env, monkeypatch):
    def skewed():
        raise ComponentSkewError(["npu-ops 0.2.0 needs interface '>=2,<3' but npu-interface provides interface 1.0"])

    monkeypatch.setattr("vllm_npu.interface.registry.check_installed_set", skewed)
    with pytest.raises(ComponentSkewError, match="npu-ops 0.2.0 needs interface"):
        EmulatedNPUPlatform.check_and_update_config(fake_vllm_config())


def test_attention_backend_is_delegated_to_npu_attention():
    path = EmulatedNPUPlatform.get_attn_backend_cls(None, 64, torch.bfloat16, "auto", 128, True, False, False, False)
    assert path == "vllm_npu.attention.backends.gqa.AscendAttentionBackend"


def test_attention_backend_takes_vllm_0_11_1_call():
    """vLLM 0.11.1 still calls an override that has use_v1 positionally, with attn_type as a tenth argument."""
    path = EmulatedNPUPlatform.get_attn_backend_cls(
        None, 64, torch.bfloat16, "auto", 128, True, False, False, False, "decoder"
    )
    assert path == "vllm_npu.attention.backends.gqa.AscendAttentionBackend"


def test_missing_attention_layer_names_the_pip_command(monkeypatch):
    monkeypatch.setattr("vllm_npu.interface.registry.discover", lambda *a, **k: {})
    with pytest.raises(MissingComponentError, match=r'pip install "npu-platform\[attention\]"'):
        NPUPlatform.get_attn_backend_cls(None, 64, torch.bfloat16, "auto", 128, True, False, False, False)


def test_quantization_checks():
    EmulatedNPUPlatform.verify_quantization("ascend")  # npu-quant is installed in this workspace
    with pytest.raises(ValueError, match="fp8 quantization is currently not supported"):
        EmulatedNPUPlatform.verify_quantization("fp8")


def test_dtype_check():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        NPUPlatform.check_if_supports_dtype(dtype)
    with pytest.raises(ValueError, match="not torch.float64"):
        NPUPlatform.check_if_supports_dtype(torch.float64)


def test_npu_requested_without_npu_raises_device_unavailable(monkeypatch):
    monkeypatch.setenv("VLLM_NPU_DEVICE", "npu")
    reset_device_selection()
    try:
        with pytest.raises(DeviceUnavailableError, match="VLLM_NPU_DEVICE=npu was requested but this host cannot run"):
            NPUPlatform()
    finally:
        monkeypatch.undo()
        reset_device_selection()


def test_bad_environment_raises_at_instantiation(monkeypatch):
    monkeypatch.setenv("VLLM_NPU_EMULATED_KV_CACHE_GB", "0")
    with pytest.raises(ConfigError, match="VLLM_NPU_EMULATED_KV_CACHE_GB='0' is invalid"):
        EmulatedNPUPlatform()


def test_an_untested_vllm_is_refused_when_vllm_builds_the_platform(monkeypatch):
    """First thing in the platform's __init__ (vLLM does not swallow errors there): one message, and the override."""
    from vllm_npu.interface import distribution_version as real

    monkeypatch.setattr(
        "vllm_npu.interface.versions.distribution_version",
        lambda dist: "0.12.0" if dist == "vllm" else real(dist),
    )
    monkeypatch.delenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(ConfigError, match=r"vLLM 0\.12\.0 is installed, but this vllm-npu-plugin line is tested on"):
        EmulatedNPUPlatform()
    monkeypatch.setenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", "1")
    EmulatedNPUPlatform()  # a warning instead


def test_emulated_memory_queries_are_real_numbers():
    p = EmulatedNPUPlatform()
    free, total = p.mem_get_info()
    assert 0 < free <= total
    assert p.get_current_memory_usage() > 10 * (1 << 20)  # this process's RSS
    assert p.get_device_name() == "emulated NPU (CPU)"
