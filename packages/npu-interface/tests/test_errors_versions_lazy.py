# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Error texts, version ranges, loggers and lazy package doors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import vllm_npu.interface as interface
from npu_testkit.import_light import assert_import_light
from vllm_npu.interface import (
    ComponentSkewError,
    ConfigError,
    DeviceUnavailableError,
    KernelContractError,
    MissingComponentError,
    NPUPluginError,
    distribution_version,
    get_logger,
    in_range,
    install_command,
    lazy_exports,
)
from vllm_npu.interface.errors import LAYER_DISTRIBUTIONS
from vllm_npu.interface.targets import import_target
from vllm_npu.interface.versions import RangeCheck, parse_range


def test_missing_component_message_is_exact() -> None:
    err = MissingComponentError("quant", "this checkpoint is W8A8-quantized")
    assert str(err) == 'this checkpoint is W8A8-quantized; install the quant layer: pip install "npu-platform[quant]"'
    assert (err.layer, err.reason) == ("quant", "this checkpoint is W8A8-quantized")


def test_missing_component_with_custom_fix() -> None:
    err = MissingComponentError("ops", "need ops", fix="add npu_ops to VLLM_PLUGINS")
    assert str(err) == "need ops; add npu_ops to VLLM_PLUGINS"


def test_install_commands() -> None:
    assert install_command("interface") == 'pip install "npu-interface"'
    assert install_command("platform") == 'pip install "npu-platform"'
    for layer in ("ops", "attention", "quant", "models", "patches"):
        assert install_command(layer) == f'pip install "npu-platform[{layer}]"'
    with pytest.raises(ValueError, match="unknown layer 'gpu'; expected one of"):
        install_command("gpu")


def test_every_layer_maps_to_a_workspace_distribution() -> None:
    for dist in LAYER_DISTRIBUTIONS.values():
        assert distribution_version(dist) is not None, f"{dist} is not installed in the dev env"


def test_error_hierarchy() -> None:
    assert issubclass(MissingComponentError, ImportError)
    assert issubclass(ConfigError, ValueError) and issubclass(KernelContractError, ValueError)
    assert issubclass(ComponentSkewError, RuntimeError) and issubclass(DeviceUnavailableError, RuntimeError)
    for cls in (MissingComponentError, ConfigError, KernelContractError, ComponentSkewError, DeviceUnavailableError):
        assert issubclass(cls, NPUPluginError)


def test_skew_error_lists_problems() -> None:
    err = ComponentSkewError(["a needs x", "b needs y"])
    assert str(err) == "the installed vllm-npu components do not fit together:\n  - a needs x\n  - b needs y"
    assert err.problems == ["a needs x", "b needs y"]


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("0.11.0", ">=0.11.0,<0.12", True),
        ("0.11.2", ">=0.11.0,<0.12", True),
        ("0.11.0+cpu", ">=0.11.0,<0.12", True),
        ("0.11.0rc2", ">=0.11.0,<0.12", True),
        ("0.11.1.dev3+g1234", ">=0.11.0,<0.12", True),
        ("0.12.0", ">=0.11.0,<0.12", False),
        ("0.10.2", ">=0.11.0,<0.12", False),
        ("1.0", ">=1.0,<2", True),
        ("2.0", ">=1.0,<2", False),
        ("not-a-version", ">=0", False),
    ],
)
def test_in_range(version: str, spec: str, expected: bool) -> None:
    assert in_range(version, spec, what="test") is expected


def test_bad_range_names_its_owner() -> None:
    with pytest.raises(ValueError, match=r"npu-ops vllm range: '>>1' is not a PEP 440 version range"):
        parse_range(">>1", what="npu-ops vllm range")


def test_range_check_text() -> None:
    assert (
        str(RangeCheck("npu-ops", "vllm", ">=0.11", None)) == 'npu-ops requires vllm ">=0.11" but found not installed'
    )
    assert not RangeCheck("npu-ops", "vllm", ">=0.11", None).ok
    assert RangeCheck("npu-ops", "vllm", ">=0.11", "0.11.0").ok


def test_distribution_version() -> None:
    assert distribution_version("npu-interface") == interface.__version__
    assert distribution_version("no-such-distribution-xyz") is None


def test_get_logger_lives_under_vllm() -> None:
    assert get_logger("vllm_npu.ops.x").name == "vllm.vllm_npu.ops.x"
    assert get_logger("vllm.already").name == "vllm.already"


def test_lazy_exports_import_on_first_access() -> None:
    getattr_, dir_ = lazy_exports("json", {"dumps": "json:dumps", "Decoder": ".decoder:JSONDecoder"})
    assert getattr_("dumps") is json.dumps
    assert getattr_("Decoder").__name__ == "JSONDecoder"
    assert dir_() == ["Decoder", "dumps"]
    with pytest.raises(AttributeError, match="module 'json' has no attribute 'nope'"):
        getattr_("nope")


def test_import_target_resolves_module_attr_strings() -> None:
    assert import_target("json:dumps") is json.dumps
    assert import_target(".decoder:JSONDecoder", package="json") is json.JSONDecoder
    assert import_target("json:JSONDecoder.decode") is json.JSONDecoder.decode


@pytest.mark.parametrize("bad", ["json", "json:", ":dumps", "json:a:b", "json:du mps"])
def test_import_target_refuses_a_malformed_string(bad: str) -> None:
    with pytest.raises(ValueError, match=f"^hook {re.escape(repr(bad))} must look like 'package.module:attr'$"):
        import_target(bad, what="hook")


def test_import_target_names_the_missing_module_or_attribute() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"^hook 'json\.nope:x': no module named 'json\.nope' \(is the"):
        import_target("json.nope:x", what="hook")
    with pytest.raises(AttributeError, match=r"^hook 'json:JSONDecoder\.nope': json\.JSONDecoder has no attribute"):
        import_target("json:JSONDecoder.nope", what="hook")


def test_import_target_keeps_a_broken_modules_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that exists but fails to import is a bug to surface as it is, not a "missing target"."""
    (tmp_path / "npu_broken_target.py").write_text("import npu_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        import_target("npu_broken_target:x")
    assert info.value.name == "npu_no_such_dependency" and "npu_broken_target" not in str(info.value)


def test_every_interface_export_resolves() -> None:
    for name in interface.__all__:
        assert getattr(interface, name) is not None, name
    assert set(dir(interface)) >= set(interface.__all__) - {"__version__"}


def test_interface_import_is_free() -> None:
    """``import vllm_npu.interface`` and the device decision import neither pydantic, packaging, torch nor vLLM."""
    assert_import_light(
        "import vllm_npu.interface as i",
        "i.decide_device({'VLLM_NPU_DEVICE': 'emulated'})",
        forbid=("pydantic", "packaging", "torch", "torch_npu", "vllm"),
    )
