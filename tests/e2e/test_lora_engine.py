# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Multi-LoRA on the emulated device: real vLLM with ``enable_lora``, tiny Llama (GQA 4/2 heads), float32, one engine.

Adapters are PEFT checkpoints written by the test (``npu_testkit.lora``), of different ranks and targets:

- ``A``: rank 8, every projection (q/k/v/o/gate/up/down) plus the token embedding and the LM head;
- ``B``: rank 4, attention only (q/k/v/o);
- ``C``: rank 16 (= ``max_lora_rank``), MLP only (gate/up/down).

Reference for a request with an adapter: HF transformers greedy on the checkpoint with that adapter merged
(``W + (alpha/r)·B·A``), token for token. ``max_loras=2`` with three adapters, so a batch using all three swaps
adapters in and out of the two slots; ``max_num_batched_tokens=64`` makes the long prompt prefill in chunks.
"""

from __future__ import annotations

import re

import pytest
from npu_testkit.engine import emulated_env, engine, make_prompts, tiny_config, token_prompts
from npu_testkit.lora import ALL_PROJECTIONS, ATTENTION, MLP, merge_adapters, write_peft_adapter
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 10
MAX_LORA_RANK = 16
PROMPTS = make_prompts([1, 6, 19, 100], seed=11)
SPECS = {
    "A": {"targets": (*ALL_PROJECTIONS, "embed_tokens", "lm_head"), "rank": 8, "alpha": 16, "seed": 1},
    "B": {"targets": ATTENTION, "rank": 4, "alpha": 8, "seed": 2},
    "C": {"targets": MLP, "rank": 16, "alpha": 8, "seed": 3},
}
IDS = {"A": 1, "B": 2, "C": 3}


@pytest.fixture(scope="module")
def base():
    return build_tiny_model(tiny_config("llama"))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(base, root / name, **spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def references(base, adapters, tmp_path_factory):
    """Greedy HF tokens per prompt for the base model and for each merged adapter (computed before the engine)."""
    root = tmp_path_factory.mktemp("merged")
    refs = {None: hf_greedy(base, PROMPTS, MAX_TOKENS)}
    for name, path in adapters.items():
        refs[name] = hf_greedy(merge_adapters(base, path, root / name), PROMPTS, MAX_TOKENS)
    return refs


@pytest.fixture(scope="module")
def llm(base, references, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("lora"))
    kwargs = {"max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": MAX_LORA_RANK, "max_num_batched_tokens": 64}
    with engine(base, env, enable_lora=True, enable_prefix_caching=True, **kwargs) as llm:
        yield llm


def _request(adapters, name):
    from vllm.lora.request import LoRARequest

    return None if name is None else LoRARequest(name, IDS[name], str(adapters[name]))


def _run(llm, adapters, names, prompts=PROMPTS):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = [_request(adapters, n) for n in names]
    outs = llm.generate(token_prompts(prompts), params, lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def _lora_layout(worker) -> dict[str, str]:
    model = worker.model_runner.model
    found = {"punica": type(model.lora_manager.punica_wrapper).__name__}
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if name.startswith("model.layers.0.") or short in ("embed_tokens", "lm_head", "logits_processor"):
            base_layer = getattr(module, "base_layer", None)
            if base_layer is not None:
                found[short] = f"{type(module).__name__}({type(base_layer).__name__})"
    return found


def test_adapters_change_the_output(references):
    # otherwise the token-equality tests below would not see a missing or wrong LoRA
    for name in SPECS:
        assert references[name] != references[None], name


def test_lora_layers_wrap_our_embedding_and_vllms_linears(llm):
    from vllm_npu.ops.lora.punica import PunicaWrapperNPU  # the variant of the installed vLLM's wrapper API

    (layout,) = llm.collective_rpc(_lora_layout)
    assert layout == {
        "punica": PunicaWrapperNPU.__name__,
        "embed_tokens": "NPUVocabParallelEmbeddingWithLoRA(NPUVocabParallelEmbedding)",
        "qkv_proj": "MergedQKVParallelLinearWithLoRA(QKVParallelLinear)",
        "o_proj": "RowParallelLinearWithLoRA(RowParallelLinear)",
        "gate_up_proj": "MergedColumnParallelLinearWithLoRA(MergedColumnParallelLinear)",
        "down_proj": "RowParallelLinearWithLoRA(RowParallelLinear)",
        "logits_processor": "LogitsProcessorWithLoRA(NPULogitsProcessor)",
    }
    from vllm_npu.patches import patch_report

    (report,) = llm.collective_rpc(patch_report)
    assert report["lora-npu-layers"]["status"] == "applied" and report["lora-npu-layers"]["installed"]


def test_one_adapter_on_every_projection_embedding_and_lm_head(llm, adapters, references):
    got, _ = _run(llm, adapters, ["A"] * len(PROMPTS))
    assert got == references["A"]


def test_batch_mixing_two_adapters_and_the_base_model(llm, adapters, references):
    names = ["B", None, "A", "B"]
    got, _ = _run(llm, adapters, names)
    assert got == [references[n][i] for i, n in enumerate(names)]


def test_more_adapters_than_lora_slots(llm, adapters, references):
    # three adapters + base, two GPU slots and two CPU slots: C evicts one of A/B, which is then reloaded
    names = ["C", "A", "B", None]
    got, _ = _run(llm, adapters, names)
    assert got == [references[n][i] for i, n in enumerate(names)]
    got, _ = _run(llm, adapters, ["A", "C", "A", "C"])
    assert got == [references[n][i] for i, n in enumerate(["A", "C", "A", "C"])]


def test_prefix_cache_is_never_shared_across_adapters(llm, adapters, references):
    prompt = [PROMPTS[3]]  # 100 tokens: 6 full blocks of 16
    llm.reset_prefix_cache()
    got, outs = _run(llm, adapters, ["B"], prompt)
    assert got == [references["B"][3]] and outs[0].num_cached_tokens == 0
    got, outs = _run(llm, adapters, ["A"], prompt)  # same tokens, other adapter: nothing cached
    assert got == [references["A"][3]] and outs[0].num_cached_tokens == 0
    got, outs = _run(llm, adapters, [None], prompt)  # the base model neither
    assert got == [references[None][3]] and outs[0].num_cached_tokens == 0
    got, outs = _run(llm, adapters, ["B"], prompt)  # same adapter again: its own blocks are reused
    assert got == [references["B"][3]] and outs[0].num_cached_tokens >= 96


def test_rank_above_max_lora_rank_is_a_clear_error_and_the_engine_keeps_serving(
    llm, base, adapters, references, tmp_path
):
    from vllm.lora.request import LoRARequest

    big = write_peft_adapter(base, tmp_path / "big", rank=32, alpha=32, seed=4)
    with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        llm.llm_engine.add_lora(LoRARequest("big", 9, str(big)))
    got, _ = _run(llm, adapters, ["A", None], PROMPTS[:2])
    assert got == [references["A"][0], references[None][1]]


def test_unknown_target_module_is_a_clear_error_and_the_engine_keeps_serving(llm, base, adapters, references, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.lora.request import LoRARequest

    bad = write_peft_adapter(base, tmp_path / "bad", targets=ATTENTION, rank=4, seed=5)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn.rotary_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(64, 4)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(
        ValueError, match=r"bad, expected target modules in .* but received \['model.layers.0.self_attn.rotary_proj'"
    ):
        llm.llm_engine.add_lora(LoRARequest("bad", 10, str(bad)))
    got, _ = _run(llm, adapters, ["B", None], PROMPTS[:2])
    assert got == [references["B"][0], references[None][1]]


_LAYER0 = "base_model.model.model.layers.0"


@pytest.mark.parametrize(
    ("tensor", "shape", "message"),
    [
        # wider than the layer: vLLM alone fails in an anonymous copy_ ("The size of tensor a (64) must match ...")
        ("self_attn.q_proj.lora_A.weight", (4, 128), r"q_proj lora_a is \[4, 128\], the base model needs \[4, 64\]"),
        # narrower than the layer: vLLM alone copies it into a corner of the slot and serves a wrong answer
        ("self_attn.q_proj.lora_A.weight", (4, 32), r"q_proj lora_a is \[4, 32\], the base model needs \[4, 64\]"),
        ("self_attn.k_proj.lora_B.weight", (64, 4), r"k_proj lora_b is \[64, 4\], the base model needs \[32, 4\]"),
        ("self_attn.o_proj.lora_B.weight", (32, 4), r"o_proj lora_b is \[32, 4\], the base model needs \[64, 4\]"),
        ("mlp.down_proj.lora_A.weight", (2, 128), r"down_proj has lora_a \[2, 128\] and lora_b \[64, 4\]: rank 2 vs 4"),
    ],
    ids=["wider-in", "narrower-in", "wider-out", "narrower-out", "ranks-differ"],
)
def test_tensor_shape_mismatch_is_a_clear_error_and_the_engine_keeps_serving(
    llm, base, adapters, references, tmp_path, tensor, shape, message
):
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.lora.request import LoRARequest

    bad = write_peft_adapter(base, tmp_path / "mismatch", targets=ALL_PROJECTIONS, rank=4, seed=6)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = f"{_LAYER0}.{tensor}"
    assert key in tensors and tuple(tensors[key].shape) != shape
    tensors[key] = torch.full(shape, 0.1)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError) as err:
        llm.llm_engine.add_lora(LoRARequest("mismatch", 11, str(bad)))
    text = str(err.value)
    assert text.startswith("LoRA adapter 'mismatch' does not match the base model: model.layers.0."), text
    assert re.search(message, text), text
    # nothing of the refused adapter stayed: both slots serve A and B, the base model is untouched
    got, _ = _run(llm, adapters, ["A", "B", None], PROMPTS[:3])
    assert got == [references["A"][0], references["B"][1], references[None][2]]
