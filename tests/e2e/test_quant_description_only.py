# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""End to end: a ModelSlim checkpoint that carries only ``quant_model_description.json`` (no ``quantization_config``
in config.json, as new msModelSlim exports ship) is claimed by the ``ascend`` quant method without any
``quantization=`` argument.

A tiny Qwen2 quantized by ``vllm-npu quantize --scheme W8A8_DYNAMIC``, then ``quantization_config`` removed from its
config.json. vLLM itself would load it as a float model (it asks quant configs only about a ``quantization_config``)
and fail on the int8 tensors; ``NPUPlatform.check_and_update_config`` claims it (``vllm_npu.quant.detect``).

Checks, with ONE engine (``LLM(model=dir)``, nothing else):

- the engine config equals the one of ``quantization="ascend"`` (same method, same quant config contents);
- every decoder linear layer of the loaded model runs ``AscendLinearMethod`` with the W8A8-dynamic scheme;
- greedy tokens equal those of a pure-torch simulation of the checkpoint (``vllm_npu.quant.tools.simulate``), which
  ``test_quant_dense_schemes.py`` shows equal to the engine's tokens on the same checkpoint with its
  ``quantization_config`` (i.e. what ``--quantization ascend`` runs).
"""

from __future__ import annotations

import json

import pytest
from npu_testkit.engine import emulated_env, engine, patched_environ
from npu_testkit.quant_e2e import check_greedy, dense_methods, layer_methods, tiny_float_model

pytestmark = pytest.mark.engine

SCHEME = "W8A8_DYNAMIC"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_npu.quant.tools.cli import main as quantize_main

    float_dir = tiny_float_model("qwen2")
    quant_dir = tmp_path_factory.mktemp("quant") / SCHEME
    assert quantize_main([str(float_dir), str(quant_dir), "--scheme", SCHEME]) == 0
    config_path = quant_dir / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    assert (quant_dir / "quant_model_description.json").is_file()
    return quant_dir


@pytest.fixture(scope="module")
def llm(checkpoint, tmp_path_factory):
    with engine(checkpoint, emulated_env(tmp_path_factory.mktemp("vllm"))) as llm:
        yield llm


def test_config_is_claimed_like_an_explicit_ascend(checkpoint, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    def config(**kwargs):
        with patched_environ(emulated_env(tmp_path)):
            return EngineArgs(
                model=str(checkpoint), dtype="float32", max_model_len=256, **kwargs
            ).create_engine_config()

    claimed, explicit = config(), config(quantization="ascend")
    assert claimed.model_config.quantization == explicit.model_config.quantization == "ascend"
    assert type(claimed.quant_config) is type(explicit.quant_config)
    assert type(claimed.quant_config).__module__ == "vllm_npu.quant.config"
    assert vars(claimed.quant_config) == vars(explicit.quant_config)


def test_loaded_layers_run_the_ascend_method(llm):
    (methods,) = llm.collective_rpc(layer_methods)
    assert methods == dense_methods("W8A8DynamicScheme")


def test_generates_the_tokens_of_the_quantized_checkpoint(llm, checkpoint):
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    check_greedy(llm, simulated_hf_model(checkpoint))
