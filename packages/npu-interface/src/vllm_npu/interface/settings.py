# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The plugin's settings, listed once: names, allowed values, defaults and meanings. No pydantic here.

The platform's register hook reads ``VLLM_NPU_DEVICE`` on vLLM's start-up path, where every millisecond counts, so
this module stays dependency-free. :mod:`vllm_npu.interface.config` builds the pydantic schema from it (the
``Literal`` types below, and each field's default and description from :data:`ENV_SETTINGS` /
:data:`ADDITIONAL_CONFIG_SETTINGS`); the README's tables are :func:`markdown_rows` of the same lists (a test
compares them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple, get_args

from .errors import ConfigError

ENV_PREFIX = "VLLM_NPU_"
ENV_DEVICE = "VLLM_NPU_DEVICE"
ENV_EMULATED_KV_CACHE_GB = "VLLM_NPU_EMULATED_KV_CACHE_GB"
ENV_PATCHES = "VLLM_NPU_PATCHES"
ENV_CACHE_DIR = "VLLM_NPU_CACHE_DIR"
ENV_ALLOW_UNTESTED_VLLM = "VLLM_NPU_ALLOW_UNTESTED_VLLM"
ENV_EMULATED_SOC = "VLLM_NPU_EMULATED_SOC"

DeviceSetting = Literal["auto", "npu", "emulated", "off"]
GraphMode = Literal["auto", "eager", "piecewise", "full_decode_only", "torchair"]
KernelSetting = Literal["auto", "npu", "reference"]
EmulatedCompile = Literal["auto", "none", "inductor"]
MoEMC2Setting = Literal["auto", "on", "off"]
EmulatedSoc = Literal["none", "310P"]
DEVICE_SETTINGS: tuple[str, ...] = get_args(DeviceSetting)
GRAPH_MODES: tuple[str, ...] = get_args(GraphMode)
KERNEL_SETTINGS: tuple[str, ...] = get_args(KernelSetting)
EMULATED_COMPILE_MODES: tuple[str, ...] = get_args(EmulatedCompile)
MOE_MC2_SETTINGS: tuple[str, ...] = get_args(MoEMC2Setting)
EMULATED_SOCS: tuple[str, ...] = get_args(EmulatedSoc)

#: The key of the plugin's section inside vLLM's ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "npu"


class Setting(NamedTuple):
    """One setting. ``key`` is its schema field (``DEVICE`` for ``VLLM_NPU_DEVICE``, ``graph_mode`` for
    ``npu.graph_mode``); ``choices`` lists a closed set of values, ``values`` says in words what an open one
    accepts (Markdown: the README prints it); ``default`` is the schema's default (None or ``()``: unset)."""

    name: str
    key: str
    default: object
    meaning: str
    choices: tuple[str, ...] = ()
    values: str = ""

    @property
    def allowed(self) -> str:
        """The allowed values in words (no Markdown): the schema field's description, quoted by error messages."""
        return " | ".join(self.choices) if self.choices else self.values.replace("`", "")


def _env(name: str, default: object, meaning: str, choices: tuple[str, ...] = (), values: str = "") -> Setting:
    return Setting(name, name[len(ENV_PREFIX) :], default, meaning, choices, values)


def _key(key: str, default: object, meaning: str, choices: tuple[str, ...] = (), values: str = "") -> Setting:
    return Setting(f"{ADDITIONAL_CONFIG_KEY}.{key}", key, default, meaning, choices, values)


ENV_SETTINGS: tuple[Setting, ...] = (
    _env(
        ENV_DEVICE,
        "auto",
        "`auto` activates only where torch_npu, CANN and an NPU are present (never on a CUDA host); `npu` on a host "
        "without an NPU is a clear error",
        choices=DEVICE_SETTINGS,
    ),
    _env(
        ENV_EMULATED_KV_CACHE_GB,
        0.5,
        "KV-cache budget of the emulated device, in GiB",
        values="a float in (0, 1024]",
    ),
    _env(
        ENV_EMULATED_SOC,
        "none",
        "the chip the emulated device stands for: `310P` takes the Atlas 300I (Ascend 310P) paths and refusals "
        "(fp16 only, eager only, the NZ KV-cache layout; docs/310p.md); ignored on an NPU",
        choices=EMULATED_SOCS,
    ),
    _env(
        ENV_PATCHES,
        "all",
        "which of npu-patches' patches apply (`vllm-npu patches` lists them)",
        values="`all`, `none`, or `-<patch-id>[,-<patch-id>...]`",
    ),
    _env(
        ENV_CACHE_DIR,
        None,
        "where the plugin caches what it builds (the demo model)",
        values="a directory (default `$XDG_CACHE_HOME/vllm-npu`, i.e. `~/.cache/vllm-npu`)",
    ),
    _env(
        ENV_ALLOW_UNTESTED_VLLM,
        "0",
        "`1` runs the plugin on a vLLM outside the tested releases (`SUPPORTED_VLLM`) with a warning instead of the "
        "refusal at plugin load; untested, expect failures",
        choices=("0", "1"),
    ),
)

ADDITIONAL_CONFIG_SETTINGS: tuple[Setting, ...] = (
    _key(
        "graph_mode",
        "auto",
        "`auto` follows vLLM's `cudagraph_mode` (PIECEWISE graphs by default on the NPU, FULL_DECODE_ONLY graphs "
        "with compiled replay on the emulated device, see `npu.emulated_compile`); `torchair` compiles the decode forward per padded batch size, "
        "attention included for GQA and MLA models, and MoE layers, quantized ones included (on an NPU: GQA and "
        "MLA decoder models, MoE with unquantized, W8A8_DYNAMIC or static W8A8 experts (MC2 and data parallel with "
        "expert parallel included) with or without dynamic EPLB, and the dense quant schemes; DeepSeek-V3.2's sparse attention and "
        "W4A8_DYNAMIC MoE experts are refused) (docs/torchair.md); the others set the mode (see docs/graphs.md)",
        choices=GRAPH_MODES,
    ),
    _key(
        "emulated_compile",
        "auto",
        "emulated device: with no `--enforce-eager`, `cudagraph_mode` or `npu.graph_mode`, `auto` and `inductor` "
        "run FULL_DECODE_ONLY graphs with compiled replay at sizes 1-16 (vLLM compiles by default; eager, logged, "
        "with speculative decoding, a KV connector, more than one rank, sleep mode or a pooling model) and `none` "
        "runs eagerly; "
        "with graphs on (`piecewise`, `full_decode_only`), `inductor` compiles each captured graph's "
        "pieces between its KV-cache writes and updatable kernels with inductor, once per distinct piece and capture "
        "size at start-up, kept in `$VLLM_NPU_CACHE_DIR/emulated_compile` across restarts (off with "
        "`VLLM_DISABLE_COMPILE_CACHE=1`; needs a C++ compiler; see docs/graphs.md)",
        choices=EMULATED_COMPILE_MODES,
    ),
    _key(
        "kernels",
        "auto",
        "`reference` runs the pure-PyTorch twins (debugging on the NPU); `npu` needs an NPU",
        choices=KERNEL_SETTINGS,
    ),
    _key(
        "emulated_kv_cache_gb",
        None,
        f"overrides `{ENV_EMULATED_KV_CACHE_GB}`",
        values="a float in (0, 1024], in GiB",
    ),
    _key("disabled_patches", (), f"patches to skip, as `-<id>` in `{ENV_PATCHES}` does", values="a list of patch ids"),
    _key(
        "moe_mc2",
        "auto",
        "expert-parallel MoE steps up to the MC2 token capacity (`min(max_num_seqs * (1 + speculative tokens), "
        "512)`) use MC2's fused dispatch/combine; `auto` on an NPU: A3, or A2 from 16 EP ranks, never on the "
        "emulated device; `on` everywhere (the emulated device runs its gloo twin); see docs/moe.md",
        choices=MOE_MC2_SETTINGS,
    ),
    _key(
        "expert_map_path",
        None,
        "a static expert placement (with redundant replicas) for expert parallelism, per MoE layer (docs/moe.md)",
        values="a JSON file",
    ),
    _key(
        "multistream_overlap_shared_expert",
        False,
        "run MoE shared experts on a side stream while the routed experts run",
        values="`true` or `false`",
    ),
    _key(
        "torchair_cache",
        True,
        "`graph_mode` `torchair`: keep the compiled decode graphs in `torchair_cache_dir`, one directory per key "
        "(model, dtype, parallel ranks, versions, plugin sources), reused across restarts",
        values="`true` or `false`",
    ),
    _key(
        "torchair_cache_dir",
        None,
        "`graph_mode` `torchair`: the compile cache's root",
        values=f"a directory (default `${ENV_CACHE_DIR}/torchair`)",
    ),
)


def setting(name: str) -> Setting:
    """The :class:`Setting` called ``name`` (``"VLLM_NPU_DEVICE"``, ``"npu.graph_mode"``)."""
    for item in (*ENV_SETTINGS, *ADDITIONAL_CONFIG_SETTINGS):
        if item.name == name:
            return item
    raise KeyError(f"no setting {name!r}")


def markdown_rows(settings: Iterable[Setting]) -> list[str]:
    """``| `name` | values | meaning |`` for each setting, as the README's tables print them."""
    rows = []
    for item in settings:
        if item.choices:
            values = ", ".join(f"`{c}`" + (" (default)" if c == item.default else "") for c in item.choices)
        else:
            values = item.values + (f" (default `{item.default}`)" if item.default not in (None, ()) else "")
        rows.append(f"| `{item.name}` | {values} | {item.meaning} |")
    return rows


def read_device_setting(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_NPU_DEVICE``, validated; raises ConfigError naming the variable and the allowed values."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_DEVICE, "auto").strip().lower() or "auto"
    if value not in DEVICE_SETTINGS:
        raise ConfigError(
            f"bad environment: {ENV_DEVICE}={environ.get(ENV_DEVICE)!r} is invalid; allowed: "
            + ", ".join(repr(v) for v in DEVICE_SETTINGS)
        )
    return value


def read_emulated_soc(environ: Mapping[str, str] | None = None) -> EmulatedSoc:
    """``VLLM_NPU_EMULATED_SOC``, validated (case-insensitive; unset or empty: ``none``)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_EMULATED_SOC, "")
    value = raw.strip().upper() or "NONE"
    for soc in EMULATED_SOCS:
        if soc.upper() == value:
            return soc  # type: ignore[return-value]  # one of EmulatedSoc's members
    raise ConfigError(
        f"bad environment: {ENV_EMULATED_SOC}={raw!r} is invalid; allowed: " + ", ".join(map(repr, EMULATED_SOCS))
    )
