# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The torchair mode without an engine: its config, the cache key, the emulated stand-in backend and its cache, and
the NPU wiring against a fake ``torchair`` module that enforces the documented signatures."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CompilationLevel, CUDAGraphMode
from vllm.config.compilation import CompilationConfig
from vllm_npu.interface import AdditionalConfig, ConfigError
from vllm_npu.platform.graphs import compile_cache
from vllm_npu.platform.graphs.compile_cache import CompileCache, cache_key
from vllm_npu.platform.graphs.config import configure_graphs
from vllm_npu.platform.graphs.emulated.standin import StandInBackend
from vllm_npu.platform.graphs.torchair import TorchairStats, forward_for

# --- config -------------------------------------------------------------------------------------------------------


def graph_config(
    *,
    enforce_eager=False,
    mode=None,
    use_mla=False,
    sparse=False,
    experts=0,
    quantization=None,
    quant_cfg=None,
    dtype=torch.bfloat16,
    spec=None,
    kv_transfer=None,
    dp=1,
    tp=1,
    ep=False,
    eplb=False,
    npu=None,
    graph_mode=None,
):
    """The parts of a VllmConfig the graph config reads; ``sparse``: DeepSeek-V3.2 (MLA with ``index_topk``);
    ``quant_cfg``: config.json's ``quantization_config``; ``npu``: the plugin's additional-config section."""
    hf_config = SimpleNamespace(quantization_config=quant_cfg, **({"index_topk": 2048} if sparse else {}))
    section = {**(npu or {}), **({} if graph_mode is None else {"graph_mode": graph_mode})}
    return SimpleNamespace(
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4]),
        model_config=SimpleNamespace(
            enforce_eager=enforce_eager,
            get_num_layers=lambda parallel: 2,
            use_mla=use_mla or sparse,
            hf_config=hf_config,
            hf_text_config=SimpleNamespace(num_experts=experts),
            model="/nonexistent-model-dir",
            quantization=quantization,
            dtype=dtype,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep, enable_eplb=eplb
        ),
        additional_config={"npu": section} if section else None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        speculative_config=spec,
        kv_transfer_config=kv_transfer,
    )


def _description(*types: str, experts: str | None = None, **settings: str) -> dict[str, str]:
    """An old-style msModelSlim description in config.json's quantization_config (one tensor per type, and with
    ``experts`` a routed expert of that type)."""
    desc = {f"model.layers.{i}.mlp.down_proj.weight": t for i, t in enumerate(types)}
    if experts is not None:
        desc["model.layers.9.mlp.experts.0.down_proj.weight"] = experts
    return desc | settings


def test_torchair_runs_full_decode_only_dispatch_without_dynamo_pieces():
    cfg = graph_config(mode=CUDAGraphMode.FULL_AND_PIECEWISE)  # vLLM's default does not conflict
    plan = configure_graphs(cfg, "torchair", emulated=True)
    comp = cfg.compilation_config
    assert plan.mode == "FULL_DECODE_ONLY" and "torchair" in plan.reason
    assert comp.level == CompilationLevel.NO_COMPILATION and comp.cudagraph_capture_sizes == [4, 2, 1]
    assert comp.bs_to_padded_graph_size[3] == 4  # decode batches pad to the next compiled size


@pytest.mark.parametrize("use_mla", [False, True], ids=["gqa", "mla"])
def test_torchair_runs_gqa_and_mla_models_on_an_npu(use_mla):
    plan = configure_graphs(graph_config(use_mla=use_mla), "torchair", emulated=False)
    assert plan.mode == "FULL_DECODE_ONLY" and plan.capture_sizes == (1, 2, 4)


ASCEND = {"quantization": "ascend"}


@pytest.mark.parametrize(
    ("model", "in_graph"),
    [({}, True), ({"use_mla": True}, True), ({"use_mla": True, "experts": 8}, True), ({"sparse": True}, False)],
    ids=["gqa", "mla", "mla-moe", "sfa"],
)
def test_attention_is_in_the_graph_for_every_model_but_sparse_attention(model, in_graph):
    from vllm_npu.platform.graphs.torchair import attention_in_graph

    assert attention_in_graph(graph_config(graph_mode="torchair", **model)) is in_graph
    assert attention_in_graph(graph_config(graph_mode="full_decode_only", **model)) is False  # torchair only


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ({"sparse": True}, r"DeepSeek-V3.2's sparse attention \(SFA\): .*opaque op.*npu_sparse_flash_attention"),
        (
            {"experts": 8, "quantization": "ascend"},  # "ascend" without a readable description
            r"quantized MoE models whose routed experts' quant types cannot be read",
        ),
        ({"experts": 8, "dp": 2}, r"MoE models with data parallel > 1 without expert parallelism or with tensor"),
        ({"experts": 8, "dp": 2, "ep": True, "tp": 2}, r"MoE models with data parallel > 1 .* tensor parallel > 1"),
        ({"use_mla": True, "experts": 8, "dp": 2}, r"MoE models with data parallel > 1"),  # MLA: the MoE reason
        (
            {**ASCEND, "quant_cfg": _description("W8A8", kv_quant_type="C8")},
            r"checkpoints with an int8 KV cache \(C8\)",
        ),
        (
            {**ASCEND, "quant_cfg": _description("W8A8"), "dtype": torch.float32},
            r"quantized checkpoints served in float32: .*npu_quant_matmul",
        ),
        ({"quantization": "fp8"}, r"quantization methods other than npu-quant's 'ascend'"),
    ],
)
def test_torchair_on_an_npu_refuses_what_is_not_converted_with_the_reason(model, match):
    with pytest.raises(ConfigError, match=r"npu.graph_mode='torchair' is not supported on an NPU for " + match):
        configure_graphs(graph_config(**model), "torchair", emulated=False)
    configure_graphs(graph_config(**model), "torchair", emulated=True)  # the emulated device runs them all


@pytest.mark.parametrize(
    "model",
    [
        {"experts": 8, "eplb": True, "ep": True},  # dynamic EPLB: tables read as graph inputs, load counted in it
        {"experts": 8, "eplb": True, "ep": True, "use_mla": True},
        {"experts": 8, "use_mla": True, "npu": {"multistream_overlap_shared_expert": True}},  # torchair stream scope
        {"experts": 8},  # unquantized MoE, no expert parallelism
        {"use_mla": True, "experts": 8},  # DeepSeek-V2/V3: MLA and MoE both in the graph
        {"experts": 8, "ep": True, "npu": {"moe_mc2": "auto"}},  # EP over replicated tokens
        {"experts": 8, "ep": True, "npu": {"moe_mc2": "on"}},  # MC2 in the graph (chosen per compiled size)
        {"experts": 8, "dp": 2, "ep": True},  # DP attention + EP: static all-gather / reduce-scatter
        {"experts": 8, "dp": 2, "ep": True, "npu": {"moe_mc2": "on"}},  # ... or MC2
        {"use_mla": True, "experts": 8, "dp": 2, "ep": True},  # DeepSeek with DP + EP
        *({**ASCEND, "quant_cfg": _description(t)} for t in ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC")),
        # quantized MoE: W8A8_DYNAMIC or static W8A8 experts (DeepSeek's mix: static W8A8 attention, dynamic experts)
        *(
            {"experts": 8, **ASCEND, "quant_cfg": _description("W8A8", experts=t)}
            for t in ("W8A8_DYNAMIC", "W8A8", "W4A8_DYNAMIC")
        ),
        # W4A8_DYNAMIC experts run vllm-ascend v0.11.0's int8 x int4 grouped matmul (converter: int32 -> int4, int64
        # scale -> uint64), no longer refused
        {"experts": 8, **ASCEND, "quant_cfg": _description("W8A8_DYNAMIC", experts="W4A8_DYNAMIC")},
        {"experts": 8, "use_mla": True, **ASCEND, "quant_cfg": _description("W8A8", experts="W8A8_DYNAMIC")},
        {**ASCEND, "quant_cfg": _description("W4A4_FLATQUANT_DYNAMIC", "FLOAT"), "dtype": torch.float16},
    ],
)
def test_torchair_on_an_npu_runs_moe_and_dense_quant_schemes(model):
    plan = configure_graphs(graph_config(**model), "torchair", emulated=False)
    assert plan.mode == "FULL_DECODE_ONLY"


@pytest.mark.parametrize("use_mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("emulated", [True, False])
def test_torchair_with_attention_in_the_graph_runs_speculative_decoding(emulated, use_mla):
    # Verification steps are laid out one row per token (GraphDecodeInputs.per_token): compiled on either device.
    spec = SimpleNamespace(num_speculative_tokens=3)
    plan = configure_graphs(graph_config(spec=spec, use_mla=use_mla), "torchair", emulated=emulated)
    assert plan.mode == "FULL_DECODE_ONLY"
    configure_graphs(graph_config(spec=spec, sparse=True), "torchair", emulated=True)  # SFA: the opaque op


def test_torchair_with_enforce_eager_names_the_key():
    with pytest.raises(ConfigError, match=r"npu.graph_mode='torchair' conflicts with enforce_eager=True"):
        configure_graphs(graph_config(enforce_eager=True), "torchair", emulated=True)


def test_torchair_with_another_cudagraph_mode_names_both_keys():
    with pytest.raises(ConfigError, match=r"npu.graph_mode='torchair' conflicts with .*cudagraph_mode=PIECEWISE"):
        configure_graphs(graph_config(mode=CUDAGraphMode.PIECEWISE), "torchair", emulated=True)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"graph_mode": "torchair", "torchair_cachedir": "/x"}, r"npu.torchair_cachedir is not a known key"),
        ({"graph_mode": "torchair", "torchair_cache": "sometimes"}, r"npu.torchair_cache='sometimes' is invalid"),
        ({"graph_mode": "torchair", "torchair_cache_dir": ""}, r"npu.torchair_cache_dir=''"),
        ({"graph_mode": "piecewise", "torchair_cache": False}, r"npu.torchair_cache applies only to .*'torchair'"),
    ],
)
def test_bad_torchair_options_name_the_key(section, match):
    with pytest.raises(ConfigError, match=match):
        AdditionalConfig.from_vllm({"npu": section})


# --- cache key ----------------------------------------------------------------------------------------------------


def key_config(dtype="torch.float32", block_size=16, tp=1, model_hash="abc"):
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/m", dtype=dtype, compute_hash=lambda: model_hash),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1),
    )


def digest(cfg, *, rank=0, kernels="auto"):
    key = cache_key(cfg, device_type="emulated", kernels=kernels, tp_rank=rank, pp_rank=0)
    return CompileCache(Path("/c"), key).digest


def test_cache_key_changes_with_everything_that_invalidates_it(monkeypatch):
    base = digest(key_config())
    assert digest(key_config()) == base  # stable
    changed = [
        digest(key_config(dtype="torch.bfloat16")),
        digest(key_config(block_size=128)),
        digest(key_config(tp=2)),
        digest(key_config(model_hash="def")),
        digest(key_config(), rank=1),
        digest(key_config(), kernels="reference"),
    ]
    monkeypatch.setattr(compile_cache, "_version", lambda dist: "9.9" if dist == "torch" else None)
    changed.append(digest(key_config()))
    monkeypatch.undo()
    compile_cache.plugin_source_digest.cache_clear()
    monkeypatch.setattr(compile_cache, "plugin_source_digest", lambda: "edited")
    changed.append(digest(key_config()))
    assert base not in changed and len(set(changed)) == len(changed)


def test_cache_key_holds_the_cann_version(monkeypatch, tmp_path):
    """A CANN upgrade (GE compiles torchair's graphs for CANN's operator library) is a new cache directory."""
    info = tmp_path / "cann" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "cann"))
    info.write_text("version=8.2.RC1\n")
    key = cache_key(key_config(), device_type="npu", kernels="auto", tp_rank=0, pp_rank=0)
    assert key["cann"] == "8.2.RC1"
    before = CompileCache(tmp_path, key).digest
    info.write_text("version=8.3.RC1\n")
    after = CompileCache(tmp_path, cache_key(key_config(), device_type="npu", kernels="auto", tp_rank=0, pp_rank=0))
    assert after.key["cann"] == "8.3.RC1" and after.digest != before


def test_cache_directory_holds_the_key_in_clear(tmp_path):
    cache = CompileCache(tmp_path, cache_key(key_config(), device_type="npu", kernels="auto", tp_rank=0, pp_rank=0))
    directory = cache.prepare()
    assert directory.parent == tmp_path and (directory / "key.json").read_text().count('"tp_rank": 0') == 1
    assert cache.artifact(4, "f" * 64).name == f"bs4-{'f' * 24}.pt"


# --- per-size forward copies --------------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return torch.relu(self.proj(x)) * scale


def test_forward_for_gives_each_size_its_own_code_object():
    model = Tiny()
    one, two = forward_for(model, 1), forward_for(model, 2)
    assert one.__code__ is not two.__code__ and one.__name__ == "forward_torchair_bs1"
    x = torch.randn(3, 4)
    assert torch.equal(one({}, x), model(x)) and torch.equal(two({}, x, scale=3.0), model(x, scale=3.0))


# --- the emulated stand-in and its cache --------------------------------------------------------------------------


def compiled(model, size, cache, stats):
    return torch.compile(forward_for(model, size), backend=StandInBackend(size, cache, stats), fullgraph=True)


def test_stand_in_caches_the_lowered_graph_and_a_fresh_compile_loads_it(tmp_path):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    cache = CompileCache(tmp_path, {"k": 1})
    cache.prepare()
    cold, warm = TorchairStats(), TorchairStats()
    with torch.inference_mode():
        expected = model(x)
        assert torch.equal(compiled(model, 2, cache, cold)({}, x), expected)
        assert (cold.lowerings, cold.cache_writes, cold.cache_hits) == (1, 1, 0)
        # A new compile of the same graph (a restarted engine: a new code object, Dynamo traces again).
        assert torch.equal(compiled(model, 2, cache, warm)({}, x), expected)
        assert (warm.lowerings, warm.cache_hits) == (0, 1)
        # The loaded graph is what runs: new weights are graph inputs, not baked into the artifact.
        model.proj.weight.mul_(-1)
        assert torch.equal(compiled(model, 2, cache, warm)({}, x), model(x))
        assert warm.cache_hits == 2
        # Another shape is another graph: a miss, a second artifact.
        assert torch.equal(compiled(model, 3, cache, warm)({}, torch.ones(3, 4)), model(torch.ones(3, 4)))
    assert (warm.lowerings, warm.cache_writes) == (1, 1)
    assert len(list(cache.directory.glob("bs*.pt"))) == 2


def test_stand_in_without_cache_writes_nothing(tmp_path):
    stats = TorchairStats()
    with torch.inference_mode():
        compiled(Tiny(), 1, None, stats)({}, torch.randn(1, 4))
    assert (stats.lowerings, stats.cache_writes, stats.cache_hits) == (1, 0, 0)
    assert list(tmp_path.iterdir()) == []


# --- NPU wiring ---------------------------------------------------------------------------------------------------


class FakeTorchair(types.ModuleType):
    """``torchair`` as documented (CompilerConfig, get_npu_backend, inference.cache_compile), recording calls."""

    def __init__(self) -> None:
        super().__init__("torchair")
        self.calls: list[tuple[str, dict]] = []
        fake = self

        class CompilerConfig:
            def __init__(self) -> None:
                self.mode = "max-autotune"
                # torch_npu 2.8.0 experimental_config.py defaults
                self.experimental_config = SimpleNamespace(
                    frozen_parameter=False, tiling_schedule_optimize=False, enable_view_optimize=True
                )

        def get_npu_backend(*, compiler_config=None, custom_decompositions={}):  # noqa: B006 (the documented default)
            fake.calls.append(("get_npu_backend", {"compiler_config": compiler_config}))

            def npu_backend(gm, example_inputs):
                fake.calls.append(("backend", {"graph": gm}))
                return gm.forward

            npu_backend.compiler_config = compiler_config
            return npu_backend

        def cache_compile(
            func, *, config=None, backend=None, dynamic=True, cache_dir=None, global_rank=None, tp_rank=None,
            pp_rank=None, custom_decompositions=None, ge_cache=False, **kwargs,
        ):  # fmt: skip
            fake.calls.append(
                ("cache_compile", {"func": func, "backend": backend, "dynamic": dynamic, "cache_dir": cache_dir,
                                   "ge_cache": ge_cache, **kwargs})
            )  # fmt: skip
            return func

        self.CompilerConfig = CompilerConfig
        self.get_npu_backend = get_npu_backend
        self.inference = SimpleNamespace(cache_compile=cache_compile)


@pytest.fixture
def fake_torchair(monkeypatch):
    fake = FakeTorchair()
    monkeypatch.setitem(sys.modules, "torchair", fake)

    def set_compile_mode(jit_compile=False):  # torch_npu 2.8.0 npu/npu_config.py:88
        fake.calls.append(("set_compile_mode", {"jit_compile": jit_compile}))

    monkeypatch.setattr(torch, "npu", SimpleNamespace(set_compile_mode=set_compile_mode), raising=False)
    return fake


def test_npu_compiles_with_torchairs_backend_fullgraph_dynamic_ints(fake_torchair):
    from vllm_npu.platform.graphs._torchair_npu import compile_npu

    model = Tiny()
    fn = compile_npu(forward_for(model, 2), cache_dir=None)
    x = torch.randn(2, 4)
    assert torch.equal(fn({}, x), model(x))
    (mode, mode_args), (name, args), *rest = fake_torchair.calls
    # vllm-ascend v0.11.0 torchair_model_runner.py: binary kernels, then its CompilerConfig on A2/A3.
    assert mode == "set_compile_mode" and mode_args == {"jit_compile": False}
    experimental = args["compiler_config"].experimental_config
    assert name == "get_npu_backend" and experimental.frozen_parameter is True
    assert experimental.tiling_schedule_optimize is True and experimental.enable_view_optimize is True
    assert args["compiler_config"].mode == "max-autotune"
    assert [c[0] for c in rest] == ["backend"]  # torch.compile handed Dynamo's graph to torchair's backend
    torch._dynamo.reset()


def test_npu_cache_goes_through_torchair_cache_compile(fake_torchair, tmp_path):
    from vllm_npu.platform.graphs._torchair_npu import compile_npu

    fn = forward_for(Tiny(), 4)
    assert compile_npu(fn, cache_dir=str(tmp_path)) is fn
    (mode, _), (_, backend_args), (name, args) = fake_torchair.calls
    assert mode == "set_compile_mode"
    assert name == "cache_compile" and args["func"] is fn and args["cache_dir"] == str(tmp_path)
    assert args["backend"].compiler_config is backend_args["compiler_config"]
    assert args["dynamic"] is True and args["fullgraph"] is True and args["ge_cache"] is False


def bare_wrapper(tmp_path, device_type):
    """A TorchairWrapper around Tiny without vLLM's engine state (no __init__): what dispatch and compile use."""
    from collections import Counter

    from vllm_npu.platform.graphs.torchair import TorchairWrapper

    wrapper = object.__new__(TorchairWrapper)
    wrapper.runnable, wrapper.runtime_mode, wrapper.device_type = Tiny(), CUDAGraphMode.FULL, device_type
    wrapper.cache = CompileCache(tmp_path, {"k": device_type})
    wrapper.compiled, wrapper.compile_counts = {}, Counter()
    wrapper.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    return wrapper


def test_wrapper_on_npu_compiles_each_decode_size_through_torchair(fake_torchair, tmp_path, monkeypatch):
    from vllm.forward_context import BatchDescriptor
    from vllm_npu.platform.graphs import torchair

    wrapper = bare_wrapper(tmp_path, "npu")
    x = torch.randn(2, 4)
    context = SimpleNamespace(
        cudagraph_runtime_mode=CUDAGraphMode.FULL,
        batch_descriptor=BatchDescriptor(2, True),
        attn_metadata={"layers.0": SimpleNamespace()},  # a scheduled step (None is a DP rank's dummy batch: eager)
    )
    monkeypatch.setattr(torchair, "get_forward_context", lambda: context)
    assert torch.equal(wrapper(x), wrapper.runnable(x))
    assert torch.equal(wrapper(x), wrapper.runnable(x))  # the second step reuses the compiled size
    names = [name for name, _ in fake_torchair.calls]
    assert names == ["set_compile_mode", "get_npu_backend", "cache_compile"]
    args = fake_torchair.calls[2][1]
    assert args["func"].__name__ == "forward_torchair_bs2" and args["cache_dir"] == str(wrapper.cache.directory)
    context.cudagraph_runtime_mode = CUDAGraphMode.NONE  # a prefill/mixed step: eager, nothing compiled
    assert torch.equal(wrapper(torch.ones(5, 4)), wrapper.runnable(torch.ones(5, 4)))
    assert list(wrapper.compiled) == [2] and len(fake_torchair.calls) == 3


def test_wrapper_counts_a_second_compile_of_a_size_as_a_recompile(tmp_path):
    from vllm_npu.platform.graphs import torchair

    wrapper = bare_wrapper(tmp_path, "emulated")
    before = torchair.TORCHAIR_STATS.recompiles
    count = wrapper._counted(3, lambda gm, inputs: gm.forward)
    graph = torch.fx.symbolic_trace(Tiny())
    count(graph, [])
    assert torchair.TORCHAIR_STATS.recompiles == before and wrapper.compile_counts[3] == 1
    count(graph, [])
    assert torchair.TORCHAIR_STATS.recompiles == before + 1 and wrapper.compile_counts[3] == 2


@pytest.mark.parametrize("use_mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("emulated", [True, False])
@pytest.mark.parametrize(
    "connector", ["MooncakeConnectorV1", "MooncakeConnector", "NixlConnector", "OffloadingConnector"]
)
def test_torchair_runs_connectors_that_move_kv_around_the_step(connector, emulated, use_mla):
    # Their per-layer hooks are empty: their loads and saves run around the model's forward, outside the graph.
    import vllm_npu.kv._hooks as kv_hooks

    kv_hooks.register()  # as vLLM's general-plugin load does in every process
    kv_transfer = SimpleNamespace(kv_connector=connector, kv_connector_module_path=None)
    plan = configure_graphs(graph_config(kv_transfer=kv_transfer, use_mla=use_mla), "torchair", emulated=emulated)
    assert plan.mode == "FULL_DECODE_ONLY"


@pytest.mark.parametrize("use_mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("emulated", [True, False])
# LMCache is not installed here: an unresolvable connector is refused too, its import error in the message
@pytest.mark.parametrize(
    "connector", ["SharedStorageConnector", "LMCacheConnectorV1", "P2pNcclConnector", "MultiConnector"]
)
def test_torchair_with_attention_in_the_graph_refuses_a_layerwise_kv_connector(connector, emulated, use_mla):
    kv_transfer = SimpleNamespace(kv_connector=connector, kv_connector_module_path=None)
    with pytest.raises(ConfigError, match=rf"'torchair' conflicts with the KV connector '?{connector}\b.*skips them"):
        configure_graphs(graph_config(kv_transfer=kv_transfer, use_mla=use_mla), "torchair", emulated=emulated)
    configure_graphs(graph_config(kv_transfer=kv_transfer, sparse=True), "torchair", emulated=True)  # the opaque op


def test_empty_function_tells_pass_and_docstring_bodies_from_work():
    from vllm_npu.platform.graphs.config import _empty_function

    def passes(self, layer_name):
        pass

    def documented(self, layer_name):
        """Nothing to do."""

    def returns_none(self, layer_name):
        return None

    def works(self, layer_name):
        self.loaded.add(layer_name)

    def waits(self, layer_name):
        return self.event.wait()

    assert _empty_function(passes) and _empty_function(documented) and _empty_function(returns_none)
    assert not _empty_function(works) and not _empty_function(waits) and not _empty_function(None)
