# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A msModelSlim checkpoint without the quant layer fails with the install command, through vLLM's real config path.

Each run is a fresh interpreter (vLLM's quantization registry and our platform are per process) that builds
``EngineArgs(...).create_engine_config()`` on the emulated device; no engine starts. The quant layer is hidden the way
an install without it looks: its entry points are absent and ``import vllm_npu.quant`` fails. Or it is installed but
left out by ``VLLM_PLUGINS``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env

INSTALL = 'install the quant layer: pip install "npu-platform[quant]"'
W8A8_DESCRIPTION = {
    "model_quant_type": "W8A8",
    "model.layers.0.mlp.down_proj.weight": "W8A8",
    "lm_head.weight": "FLOAT",
}
OLD_DESCRIPTION = {"model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC", "lm_head.weight": "FLOAT"}

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)

# Hides vllm_npu.quant in the child before anything imports vLLM or our registry.
_HIDE_QUANT = """
import importlib.abc, importlib.metadata as md, sys

class _NoQuant(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_npu.quant" or name.startswith("vllm_npu.quant."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoQuant())
_entry_points = md.entry_points

def _without_quant(**params):
    found = _entry_points(**params)
    if not params:
        return found
    return md.EntryPoints([ep for ep in found if not ep.value.startswith("vllm_npu.quant")])

md.entry_points = _without_quant
"""

# Builds the VllmConfig of every case given as argv[1] (JSON: [[name, model_dir, quantization-or-null], ...]) and
# prints one JSON line of {name: [error type, message] or [None, chosen quantization]}.
_BUILD = """
import json, sys
from vllm.engine.arg_utils import EngineArgs

out = {}
for name, model, quantization in json.loads(sys.argv[1]):
    try:
        cfg = EngineArgs(
            model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=256, quantization=quantization
        ).create_engine_config()
        out[name] = [None, cfg.model_config.quantization]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps(out))
"""


def _checkpoint(root: Path, name: str, *, quantization_config: dict | None, description: dict | None) -> str:
    from npu_testkit.engine import tiny_config

    path = root / name
    tiny_config("qwen2", architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    if quantization_config is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    if description is not None:
        (path / "quant_model_description.json").write_text(json.dumps(description))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "description_only": _checkpoint(root, "desc", quantization_config=None, description=W8A8_DESCRIPTION),
        "quant_method_ascend": _checkpoint(
            root, "ascend", quantization_config={"quant_method": "ascend"}, description=W8A8_DESCRIPTION
        ),
        "old_style_config": _checkpoint(root, "old", quantization_config=OLD_DESCRIPTION, description=None),
        "float": _checkpoint(root, "float", quantization_config=None, description=None),
    }


def _build(cases: list[tuple[str, str, str | None]], tmp_path: Path, *, hide_quant: bool, extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(emulated_env(tmp_path, extra=extra_env))
    code = (_HIDE_QUANT if hide_quant else "") + _BUILD
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_quant_layer_not_installed(checkpoints: dict[str, str], tmp_path: Path) -> None:
    cases = [
        ("description_only", checkpoints["description_only"], None),
        ("quant_method_ascend", checkpoints["quant_method_ascend"], None),
        ("old_style_config", checkpoints["old_style_config"], None),
        ("flag_on_description_only", checkpoints["description_only"], "ascend"),
        ("float", checkpoints["float"], None),
    ]
    got = _build(cases, tmp_path, hide_quant=True, extra_env={})
    expected_source = {
        "description_only": "(quant_model_description.json; scheme W8A8)",
        "quant_method_ascend": "(config.json quantization_config; scheme W8A8)",
        "old_style_config": "(config.json quantization_config; scheme W8A8_DYNAMIC)",
        "flag_on_description_only": "(--quantization ascend; scheme W8A8)",
    }
    for name, source in expected_source.items():
        model = checkpoints[name.replace("flag_on_", "")]
        assert got[name] == [
            "MissingComponentError",
            f"the checkpoint {model!r} is msModelSlim-quantized {source} and needs the 'ascend' quantization method "
            f"of the quant layer; {INSTALL}",
        ], name
    # A float checkpoint is untouched by the gate.
    assert got["float"] == [None, None]


def test_quant_layer_left_out_by_vllm_plugins(checkpoints: dict[str, str], tmp_path: Path) -> None:
    plugins = "npu,npu_ops,npu_attention,npu_models,npu_patches"
    cases = [
        ("description_only", checkpoints["description_only"], None),
        ("quant_method_ascend", checkpoints["quant_method_ascend"], None),
    ]
    got = _build(cases, tmp_path, hide_quant=False, extra_env={"VLLM_PLUGINS": plugins})
    for name in ("description_only", "quant_method_ascend"):
        kind, message = got[name]
        assert kind == "MissingComponentError", got[name]
        assert message.startswith(f"the checkpoint {checkpoints[name]!r} is msModelSlim-quantized"), message
        assert f"VLLM_PLUGINS={plugins!r} leaves out its plugin 'npu_quant'" in message, message
