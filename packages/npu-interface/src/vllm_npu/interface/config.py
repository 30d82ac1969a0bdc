# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Configuration schema: the ``VLLM_NPU_*`` environment variables and the ``npu`` section of vLLM's
``--additional-config``. Both are validated with pydantic; every error names the bad key and what it accepts.

Environment variables (all optional):

============================== ======================================= ==============================================
variable                       values                                  meaning
============================== ======================================= ==============================================
``VLLM_NPU_DEVICE``            ``auto`` | ``npu`` | ``emulated`` |     which device the platform drives; ``auto``
                               ``off`` (default ``auto``)              activates only where an Ascend NPU is visible
``VLLM_NPU_EMULATED_KV_CACHE_GB`` float > 0 (default ``0.5``)          KV-cache budget of the emulated device, in GiB
``VLLM_NPU_PATCHES``           ``all`` (default) | ``none`` |          which patches of npu-patches apply:
                               ``-<id>[,-<id>...]``                    ``-<id>`` disables one patch
``VLLM_NPU_CACHE_DIR``         a directory (default                    where the plugin caches what it builds (the
                               ``~/.cache/vllm-npu``)                  demo model)
============================== ======================================= ==============================================

``--additional-config '{"npu": {...}}'`` keys: see :class:`AdditionalConfig`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError
from .settings import ADDITIONAL_CONFIG_KEY, ENV_PREFIX, read_device_setting

DeviceSetting = Literal["auto", "npu", "emulated", "off"]
GraphMode = Literal["auto", "eager", "piecewise", "full_decode_only", "torchair"]
KernelSetting = Literal["auto", "npu", "reference"]


def _describe(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """Allowed values of the field at ``loc`` (its Literal choices or its annotation)."""
    field = model.model_fields.get(str(loc[0])) if loc else None
    if field is None:
        return "one of " + ", ".join(sorted(model.model_fields))
    args = getattr(field.annotation, "__args__", None)
    if args and all(isinstance(a, str) for a in args):
        return "one of " + ", ".join(repr(a) for a in args)
    return field.description or str(field.annotation)


def _raise_config_error(model: type[BaseModel], exc: ValidationError, *, source: str, naming: Any) -> None:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = naming(loc)
        if err["type"] == "extra_forbidden":
            problems.append(
                f"{key} is not a known key; known keys: {', '.join(sorted(naming((k,)) for k in model.model_fields))}"
            )
        else:
            value = err.get("input")
            problems.append(f"{key}={value!r} is invalid ({err['msg']}); allowed: {_describe(model, loc)}")
    raise ConfigError(f"bad {source}: " + "; ".join(problems)) from None


class EnvConfig(BaseModel):
    """The ``VLLM_NPU_*`` environment variables, parsed and validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    DEVICE: DeviceSetting = Field("auto", description="auto | npu | emulated | off")
    EMULATED_KV_CACHE_GB: float = Field(0.5, gt=0, le=1024, description="a float in (0, 1024], in GiB")
    PATCHES: str = Field("all", description="all | none | -<patch-id>[,-<patch-id>...]")
    CACHE_DIR: str | None = Field(None, description="a directory path (default ~/.cache/vllm-npu)")

    @field_validator("PATCHES")
    @classmethod
    def _check_patches(cls, value: str) -> str:
        value = value.strip()
        if value in ("all", "none", ""):
            return value or "all"
        for item in value.split(","):
            item = item.strip()
            if not item.startswith("-") or len(item) < 2:
                raise ValueError(f"item {item!r} must look like -<patch-id>")
        return value

    @property
    def disabled_patches(self) -> frozenset[str]:
        """Patch ids disabled by ``VLLM_NPU_PATCHES``; ``{"*"}`` when every patch is disabled."""
        if self.PATCHES == "none":
            return frozenset({"*"})
        if self.PATCHES == "all":
            return frozenset()
        return frozenset(item.strip()[1:] for item in self.PATCHES.split(","))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EnvConfig:
        """Read every ``VLLM_NPU_*`` variable. Unknown ``VLLM_NPU_*`` names are errors, so typos never pass silently."""
        environ = os.environ if environ is None else environ
        raw = {k[len(ENV_PREFIX) :]: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
        if "DEVICE" in raw:
            raw["DEVICE"] = read_device_setting(environ)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            _raise_config_error(
                cls, exc, source="environment", naming=lambda loc: ENV_PREFIX + str(loc[0]) if loc else ENV_PREFIX
            )
        raise AssertionError("unreachable")


class AdditionalConfig(BaseModel):
    """The plugin's section of ``--additional-config``: ``{"npu": {<key>: <value>}}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    graph_mode: GraphMode = Field(
        "auto",
        description="auto | eager | piecewise | full_decode_only | torchair; auto follows vLLM's cudagraph_mode "
        "(PIECEWISE by default on an NPU, eager on the emulated device); torchair compiles the decode forward per "
        "padded batch size",
    )
    kernels: KernelSetting = Field(
        "auto", description="auto | npu | reference; reference runs the pure-PyTorch twins (debugging on NPU)"
    )
    emulated_kv_cache_gb: float | None = Field(
        None, gt=0, le=1024, description="a float in (0, 1024] GiB; overrides VLLM_NPU_EMULATED_KV_CACHE_GB"
    )
    disabled_patches: tuple[str, ...] = Field((), description="a list of patch ids to skip")
    torchair_cache: bool = Field(
        True, description="true | false; graph_mode torchair: keep compiled decode graphs in torchair_cache_dir"
    )
    torchair_cache_dir: str | None = Field(
        None,
        min_length=1,
        description="a directory (default <VLLM_NPU_CACHE_DIR>/torchair); graph_mode torchair: the compile cache",
    )

    @classmethod
    def from_vllm(cls, additional_config: Mapping[str, Any] | None) -> AdditionalConfig:
        """Validate the ``npu`` section of vLLM's ``additional_config`` (missing section = defaults)."""
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        if not isinstance(section, Mapping):
            raise ConfigError(
                f"bad --additional-config: {ADDITIONAL_CONFIG_KEY!r} must be an object like "
                f'{{"{ADDITIONAL_CONFIG_KEY}": {{"graph_mode": "eager"}}}}, got {type(section).__name__}'
            )
        try:
            config = cls.model_validate(dict(section))
        except ValidationError as exc:
            _raise_config_error(
                cls,
                exc,
                source="--additional-config",
                naming=lambda loc: f"{ADDITIONAL_CONFIG_KEY}.{loc[0]}" if loc else ADDITIONAL_CONFIG_KEY,
            )
        stray = sorted(k for k in config.model_fields_set if k.startswith("torchair_"))
        if stray and config.graph_mode != "torchair":
            raise ConfigError(
                f"bad --additional-config: {ADDITIONAL_CONFIG_KEY}.{stray[0]} applies only to "
                f"{ADDITIONAL_CONFIG_KEY}.graph_mode='torchair' (graph_mode is {config.graph_mode!r}); set "
                f"graph_mode to 'torchair' or drop {', '.join(stray)}"
            )
        return config
