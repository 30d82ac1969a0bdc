# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm-ascend settings users bring along: its top-level ``--additional-config`` keys and ``VLLM_ASCEND_*``
environment variables (the lists of vllm-ascend v0.11.0's ``ascend_config.py`` and ``envs.py``, with the two
unprefixed runtime switches of ``envs.py`` and the older names its docs still mention; not its build variables). vLLM hands every ``--additional-config`` key to the platform and never reads the
variables, so without this check they would be ignored without a word.

Each known setting maps to our equivalent (only settings that exist in this plugin today) or to "not supported yet by
vllm-npu-plugin". The severity follows one rule:

- **error** when ignoring the setting could change what the user gets: the generated tokens (a quantised KV cache),
  the memory they planned around (a sharded LM head or o_proj in pure data parallel: ignored, each rank holds the
  full matrix), or a contract with something outside this process (an expert placement file another tool produced,
  a heat-map file they expect written, the LLMDataDist peer of a PD-disaggregated deployment, vLLM's own model
  classes that RLHF weight sync relies on);
- **warning** for everything else: performance and tuning knobs (graph capture, prefetch, multistream, fused
  kernels, weight formats, load balancing), scheduling options vLLM's own scheduler takes as flags, debugging aids,
  and settings with no meaning here. Ignoring them keeps the outputs and does not raise memory use.

A setting left at vllm-ascend's default (``False``, ``None``, ``{}``, ``"0"``...) changes nothing there either, so
it is a warning whatever its entry says. ``VLLM_ASCEND_*`` names not in the list get one warning listing them.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError
from .settings import ADDITIONAL_CONFIG_KEY, GRAPH_MODES

Severity = Literal["warning", "error"]
ENV_PREFIX = "VLLM_ASCEND_"
NOT_SUPPORTED = "not supported yet by vllm-npu-plugin"

_GRAPH = (
    f'our graph mode is --additional-config \'{{"{ADDITIONAL_CONFIG_KEY}": {{"graph_mode": <mode>}}}}\' with <mode> one '
    f"of {', '.join(repr(m) for m in GRAPH_MODES)}"
)
_SCHEDULER = (
    "vLLM's own scheduler runs; its options are vLLM's flags (--enable-chunked-prefill / "
    "--no-enable-chunked-prefill, --max-num-batched-tokens, --max-num-seqs, --long-prefill-token-threshold, "
    "--max-num-partial-prefills, --max-long-partial-prefills)"
)
_PERF = f"a performance option; {NOT_SUPPORTED}"
_EPLB = (
    "vllm-ascend's own EPLB (its policies and worker) does not run here; dynamic EPLB is vLLM's --enable-eplb with "
    '--eplb-config \'{"num_redundant_experts": <n>, "window_size": <steps>, "step_interval": <steps>}\' (float, '
    "W8A8_DYNAMIC, W4A8_DYNAMIC and W8A8 experts; docs/moe.md)"
)


@dataclass(frozen=True)
class AscendSetting:
    """One vllm-ascend setting: what it did there, what to use here, and how bad ignoring it is."""

    name: str
    severity: Severity
    did: str
    here: str
    #: vllm-ascend's default: a setting left at it (or at another "off" value) is only a warning.
    default: Any = None
    #: Whether the environment already does what ``here`` asks (then only a warning), or None.
    done: Callable[[Mapping[str, str]], bool] | None = None


def _s(name: str, severity: Severity, did: str, here: str, default: Any = None) -> AscendSetting:
    return AscendSetting(name, severity, did, here, default)


def _models_layer_filtered_out(environ: Mapping[str, str]) -> bool:
    """VLLM_PLUGINS is set and leaves npu_models out (vLLM splits it on "," without stripping)."""
    return "VLLM_PLUGINS" in environ and "npu_models" not in environ["VLLM_PLUGINS"].split(",")


#: vllm-ascend v0.11.0's top-level ``--additional-config`` keys.
ADDITIONAL_CONFIG: dict[str, AscendSetting] = {
    s.name: s
    for s in (
        _s("torchair_graph_config", "warning", "TorchAir (GE) graph mode and its capture options", _GRAPH, {}),
        _s("ascend_scheduler_config", "warning", "vllm-ascend's prefill-first scheduler", _SCHEDULER, {}),
        _s("weight_prefetch_config", "warning", "weight prefetch for attention/MoE matmuls", _PERF, {}),
        _s(
            "refresh",
            "warning",
            "rebuilt vllm-ascend's process-wide config singleton",
            "not needed: the plugin reads --additional-config afresh for every engine",
            False,
        ),
        _s(
            "kv_cache_dtype",
            "warning",
            "an int8-quantised KV cache",
            "not needed: a C8 checkpoint (kv_quant_type or kv_cache_type 'C8' in quant_model_description.json) gets "
            "the int8 KV cache with its scales automatically; other checkpoints keep the model dtype",
        ),
        _s(
            "expert_map_path",
            "error",
            "a static expert placement file (EPLB)",
            f'our key is --additional-config \'{{"{ADDITIONAL_CONFIG_KEY}": {{"expert_map_path": <file>}}}}\' (same '
            "JSON layout; docs/moe.md)",
        ),
        _s("expert_map_record_path", "error", "writes the expert load heat-map after dynamic EPLB", _EPLB),
        _s("dynamic_eplb", "warning", "dynamic expert load balancing", _EPLB, False),
        _s("init_redundancy_expert", "warning", "redundant experts at start-up", _EPLB, 0),
        _s("eplb_policy_type", "warning", "the dynamic EPLB policy", _EPLB, 1),
        _s("num_iterations_eplb_update", "warning", "the dynamic EPLB update interval", _EPLB, 400),
        _s("gate_eplb", "warning", "one-shot EPLB", _EPLB, False),
        _s("num_wait_worker_iterations", "warning", "the EPLB worker's CPU budget", _EPLB, 30),
        _s(
            "chunked_prefill_for_mla",
            "warning",
            "chunked prefill for MLA models",
            "the MLA backend always serves chunked prefill (vLLM's --enable-chunked-prefill decides)",
            False,
        ),
        _s("enable_shared_expert_dp", "warning", "shared experts replicated over data parallel ranks", _PERF, False),
        _s(
            "lmhead_tensor_parallel_size",
            "error",
            "an LM head sharded over pure data-parallel ranks (less memory per rank)",
            f"{NOT_SUPPORTED}: each rank holds the whole LM head; plan memory for it",
        ),
        _s(
            "oproj_tensor_parallel_size",
            "error",
            "o_proj sharded over pure data-parallel ranks (less memory per rank)",
            f"{NOT_SUPPORTED}: each rank holds the whole o_proj; plan memory for it",
        ),
        _s(
            "multistream_overlap_shared_expert",
            "warning",
            "shared experts on a second stream",
            f'our key is --additional-config \'{{"{ADDITIONAL_CONFIG_KEY}": {{"multistream_overlap_shared_expert": '
            "true}}'",
            False,
        ),
        _s("recompute_scheduler_enable", "warning", "vllm-ascend's recompute scheduler", _SCHEDULER, False),
        _s(
            "enable_cpu_binding",
            "warning",
            "NUMA binding of the worker processes",
            f"{NOT_SUPPORTED}; bind with numactl/taskset when you start vLLM",
            False,
        ),
    )
}

#: vllm-ascend v0.11.0's runtime environment variables (the build-time ones, e.g. SOC_VERSION, build nothing here).
ENVIRONMENT: dict[str, AscendSetting] = {
    s.name: s
    for s in (
        _s(
            "VLLM_ASCEND_TRACE_RECOMPILES",
            "warning",
            "logs torch.compile recompilations",
            "TORCH_LOGS=recompiles (torch's own switch)",
            "0",
        ),
        _s("VLLM_ASCEND_ENABLE_DBO", "warning", "dual-batch overlap for DeepSeek", _PERF, "0"),
        _s("VLLM_ASCEND_MODEL_EXECUTE_TIME_OBSERVE", "warning", "logs model execution times", NOT_SUPPORTED, "0"),
        _s(
            "VLLM_ASCEND_KV_CACHE_MEGABYTES_FLOATING_TOLERANCE",
            "warning",
            "the cached-KV-size tolerance of TorchAir graphs",
            "not needed: the KV cache is sized by a profile run every start",
            "64",
        ),
        _s(
            "VLLM_ASCEND_ENABLE_TOPK_TOPP_OPTIMIZATION",
            "warning",
            "a fused top-k/top-p sampler",
            "vLLM's sampler runs",
            "1",
        ),
        _s(
            "VLLM_ASCEND_LLMDD_RPC_IP",
            "error",
            "the LLMDataDist KV connector's RPC address (PD disaggregation)",
            f"{NOT_SUPPORTED}: the LLMDataDist KV connector is not part of this plugin",
            "0.0.0.0",
        ),
        _s(
            "VLLM_ASCEND_LLMDD_RPC_PORT",
            "error",
            "the LLMDataDist KV connector's RPC port (PD disaggregation)",
            f"{NOT_SUPPORTED}: the LLMDataDist KV connector is not part of this plugin",
            "5557",
        ),
        _s(
            "VLLM_ASCEND_MLA_PA",
            "warning",
            "the paged MLA decode kernel",
            "the MLA backend picks its decode kernel itself",
            "0",
        ),
        _s("VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE", "warning", "fused matmul + all-reduce", _PERF, "0"),
        _s("VLLM_ASCEND_ENABLE_FLASHCOMM1", "warning", "FlashComm sequence-parallel communication", _PERF, "0"),
        _s("VLLM_ASCEND_ENABLE_FLASHCOMM", "warning", "FlashComm (the older name of ..._FLASHCOMM1)", _PERF, "0"),
        _s("VLLM_ASCEND_ENABLE_PREFETCH_MLP", "warning", "MLP weight prefetch", _PERF, "0"),
        _s("VLLM_ASCEND_MLP_GATE_UP_PREFETCH_SIZE", "warning", "the gate/up prefetch buffer", _PERF),
        _s("VLLM_ASCEND_MLP_DOWN_PREFETCH_SIZE", "warning", "the down-projection prefetch buffer", _PERF),
        _s("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE", "warning", "dense-model optimisations", _PERF, "0"),
        _s("VLLM_ASCEND_ENABLE_MLP_OPTIMIZE", "warning", "tensor-parallel MLP optimisations", _PERF, "0"),
        _s("VLLM_ASCEND_ENABLE_MLAPO", "warning", "the fused MLA preprocess kernel", _PERF, "0"),
        _s(
            "VLLM_ASCEND_ENABLE_NZ",
            "warning",
            "FRACTAL_NZ weights on or off",
            "the ops layer stores unquantized linear weights as FRACTAL_NZ on the NPU, with no switch; to rule the "
            f'NPU kernels out, use \'{{"{ADDITIONAL_CONFIG_KEY}": {{"kernels": "reference"}}}}\'',
            "1",
        ),
        _s(
            "VLLM_ASCEND_ENABLE_MOE_ALL2ALL_SEQ",
            "warning",
            "MoE all-to-all sequencing (removed before vllm-ascend 0.11.0)",
            _PERF,
            "0",
        ),
        _s(
            "VLLM_ASCEND_MLA_PARALLEL",
            "warning",
            "MLA parallelism for W4A8 in eager mode (an older release's switch)",
            _PERF,
            "0",
        ),
        _s("VLLM_ENABLE_FUSED_EXPERTS_ALLGATHER_EP", "warning", "fused all-gather expert parallelism", _PERF, "0"),
        AscendSetting(
            "USE_OPTIMIZED_MODEL",
            "error",
            "0 runs vLLM's own model classes instead of vllm-ascend's; RLHF weight sync relies on them",
            "leave npu_models out of VLLM_PLUGINS (VLLM_PLUGINS=npu,npu_ops,npu_attention,npu_quant,npu_patches)",
            "1",
            done=_models_layer_filtered_out,
        ),
    )
}


@dataclass(frozen=True)
class Finding:
    """One vllm-ascend setting found in this run, with its message."""

    setting: str
    severity: Severity
    message: str


def _normal(value: Any) -> Any:
    """Env-style spelling of a value: booleans and numbers as their text, ``"true"``/``"false"`` as ``"1"``/``"0"``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    text = str(value).strip().lower()
    return {"true": "1", "false": "0", "none": "", "null": ""}.get(text, text)


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is vllm-ascend's default (or, for a setting without one, empty/off)."""
    if value is None or (isinstance(value, (dict, list, tuple)) and not value):
        return True
    if isinstance(value, (dict, list, tuple)):
        return False
    if default is None:
        return _normal(value) in ("", "0")
    return _normal(value) == _normal(default)


def _finding(setting: AscendSetting, value: Any, where: str, environ: Mapping[str, str]) -> Finding:
    done = setting.done is not None and setting.done(environ)
    severity: Severity = "warning" if done or _is_default(value, setting.default) else setting.severity
    verdict = "cannot be ignored" if severity == "error" else "is ignored"
    here = f"{setting.here}: done, you can unset it" if done else setting.here
    return Finding(
        setting.name,
        severity,
        f"{where} {setting.name}={value!r} is a vllm-ascend setting ({setting.did}) and {verdict} by "
        f"vllm-npu-plugin; here: {here}",
    )


def find_ascend_settings(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> list[Finding]:
    """Every vllm-ascend key of ``additional_config`` and variable of ``environ``, known ones first, in table order;
    unknown ``VLLM_ASCEND_*`` names become one warning."""
    config = additional_config or {}
    found = [
        _finding(s, config[name], "--additional-config", environ)
        for name, s in ADDITIONAL_CONFIG.items()
        if name in config
    ]
    found += [_finding(s, environ[name], "environment", environ) for name, s in ENVIRONMENT.items() if name in environ]
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in ENVIRONMENT)
    if unknown:
        found.append(
            Finding(
                ", ".join(unknown),
                "warning",
                f"environment: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not read by "
                f"vllm-npu-plugin (nor a vllm-ascend v0.11.0 variable it knows); the plugin's variables start with "
                "VLLM_NPU_",
            )
        )
    return found


def check_ascend_settings(
    additional_config: Mapping[str, Any] | None, environ: Mapping[str, str], *, warn: Callable[[str], Any]
) -> list[Finding]:
    """Pass each warning to ``warn(message)``; raise one :class:`ConfigError` listing every error. Returns all."""
    findings = find_ascend_settings(additional_config, environ)
    errors = [f for f in findings if f.severity == "error"]
    for finding in findings:
        if finding.severity == "warning":
            warn(finding.message)
    if errors:
        raise ConfigError(_error_text(errors))
    return findings


def _error_text(errors: Iterable[Finding]) -> str:
    lines = "\n".join(f"  - {f.message}" for f in errors)
    return (
        "vllm-ascend settings that vllm-npu-plugin would otherwise ignore, changing results, memory or a contract "
        f"with another process; remove them (or use the replacement named):\n{lines}"
    )
