# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""LoRA on top of a quantized base (the ``ascend`` quant method): tiny Qwen2 quantized by ``vllm-npu quantize`` as
W8A8 (static activation scales) and as W8A8_DYNAMIC (per-token activation scales), one engine per scheme (the
module's fixtures are parametrized over the two), an adapter (rank 8) on every projection in float32.

Reference: ``vllm_npu.quant.tools.simulate`` (HF transformers with each quantized linear replaced by the scheme's maths)
plus the adapter applied by forward hooks, ``y += (alpha/r) * x @ A^T @ B^T``, on the simulated modules: the LoRA
delta is computed on the layer's float input, beside the quantized GEMM, as vLLM's LoRA layers do. A batch mixes
the adapter and the base model.
"""

from __future__ import annotations

import json

import pytest
from npu_testkit.engine import emulated_env, engine, token_prompts
from npu_testkit.lora import ALL_PROJECTIONS, write_peft_adapter
from npu_testkit.quant_e2e import PROMPTS, QuantCase, dense_methods, quantize

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
CASES = [
    QuantCase("w8a8", "W8A8", "qwen2", 0.1, dense_methods("W8A8Scheme")),
    QuantCase("w8a8_dynamic", "W8A8_DYNAMIC", "qwen2", 0.05, dense_methods("W8A8DynamicScheme")),
]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def case(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoints(case, tmp_path_factory):
    return quantize(case, tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory):
    return write_peft_adapter(checkpoints[0], tmp_path_factory.mktemp("lora") / "A", targets=ALL_PROJECTIONS, seed=7)


def _with_adapter(model, adapter_dir):
    """Forward hooks adding the adapter's delta to every adapted module of the simulated model."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    handles = []
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in tensors:
            a, b = tensors[key].float(), tensors[key.replace("lora_A", "lora_B")].float()

            def hook(mod, inputs, output, a=a, b=b):
                return output + scale * (inputs[0].float() @ a.t() @ b.t()).to(output.dtype)

            handles.append(module.register_forward_hook(hook))
    assert len(handles) == 2 * len(ALL_PROJECTIONS)  # 2 layers
    return handles


@pytest.fixture(scope="module")
def references(checkpoints, adapter):
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    model = simulated_hf_model(checkpoints[1])
    refs = {None: sim_greedy(model, PROMPTS, MAX_TOKENS)}
    handles = _with_adapter(model, adapter)
    refs["A"] = sim_greedy(model, PROMPTS, MAX_TOKENS)
    for h in handles:
        h.remove()
    assert refs["A"] != refs[None]  # the adapter changes the output
    return refs


@pytest.fixture(scope="module")
def llm(checkpoints, references, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("lora-quant"))
    with engine(checkpoints[1], env, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        yield llm


def test_lora_wraps_the_quantized_linears(llm, case):
    def lora_of(worker):
        model = worker.model_runner.get_model()
        return sorted(
            {
                (
                    type(m).__name__,
                    type(m.base_layer.quant_method).__name__,
                    type(getattr(m.base_layer.quant_method, "scheme", None)).__name__,
                )
                for m in model.modules()
                if hasattr(m, "base_layer") and hasattr(m.base_layer, "quant_method")
            }
        )

    (found,) = llm.collective_rpc(lora_of)
    (scheme,) = {s for _, _, s in case.methods}
    assert found == [
        ("MergedColumnParallelLinearWithLoRA", "AscendLinearMethod", scheme),
        ("MergedQKVParallelLinearWithLoRA", "AscendLinearMethod", scheme),
        ("RowParallelLinearWithLoRA", "AscendLinearMethod", scheme),
    ]


def test_adapter_and_base_in_one_batch_match_the_simulation(llm, adapter, references):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    names = ["A", None, "A"]
    lora = [None if n is None else LoRARequest("A", 1, str(adapter)) for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(token_prompts(PROMPTS), params, lora_request=lora, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [references[n][i] for i, n in enumerate(names)]
