# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Configuration schema: the ``VLLM_NPU_*`` environment variables and the ``npu`` section of vLLM's
``--additional-config``. Both are validated with pydantic; every error names the bad key and what it accepts.

The settings themselves (names, allowed values, defaults, meanings) are listed once, in
:mod:`vllm_npu.interface.settings`; the models here take their types, defaults and descriptions from there, and the
README's tables are rendered from the same lists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError
from .settings import (
    ADDITIONAL_CONFIG_KEY,
    ENV_ALLOW_UNTESTED_VLLM,
    ENV_CACHE_DIR,
    ENV_DEVICE,
    ENV_EMULATED_KV_CACHE_GB,
    ENV_EMULATED_SOC,
    ENV_PATCHES,
    ENV_PREFIX,
    DeviceSetting,
    EmulatedCompile,
    EmulatedSoc,
    GraphMode,
    KernelSetting,
    MoEMC2Setting,
    read_device_setting,
    read_emulated_soc,
    setting,
)


def _field(name: str, **constraints: Any) -> Any:
    """A pydantic field with the default and description that :mod:`.settings` lists for ``name``."""
    item = setting(name)
    return Field(item.default, description=item.allowed, **constraints)


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

    DEVICE: DeviceSetting = _field(ENV_DEVICE)
    EMULATED_KV_CACHE_GB: float = _field(ENV_EMULATED_KV_CACHE_GB, gt=0, le=1024)
    EMULATED_SOC: EmulatedSoc = _field(ENV_EMULATED_SOC)
    PATCHES: str = _field(ENV_PATCHES)
    CACHE_DIR: str | None = _field(ENV_CACHE_DIR)
    ALLOW_UNTESTED_VLLM: Literal["0", "1"] = _field(ENV_ALLOW_UNTESTED_VLLM)

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
        if "EMULATED_SOC" in raw:
            raw["EMULATED_SOC"] = read_emulated_soc(environ)
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

    graph_mode: GraphMode = _field(f"{ADDITIONAL_CONFIG_KEY}.graph_mode")
    emulated_compile: EmulatedCompile = _field(f"{ADDITIONAL_CONFIG_KEY}.emulated_compile")
    kernels: KernelSetting = _field(f"{ADDITIONAL_CONFIG_KEY}.kernels")
    emulated_kv_cache_gb: float | None = _field(f"{ADDITIONAL_CONFIG_KEY}.emulated_kv_cache_gb", gt=0, le=1024)
    disabled_patches: tuple[str, ...] = _field(f"{ADDITIONAL_CONFIG_KEY}.disabled_patches")
    moe_mc2: MoEMC2Setting = _field(f"{ADDITIONAL_CONFIG_KEY}.moe_mc2")
    expert_map_path: str | None = _field(f"{ADDITIONAL_CONFIG_KEY}.expert_map_path", min_length=1)
    multistream_overlap_shared_expert: bool = _field(f"{ADDITIONAL_CONFIG_KEY}.multistream_overlap_shared_expert")
    torchair_cache: bool = _field(f"{ADDITIONAL_CONFIG_KEY}.torchair_cache")
    torchair_cache_dir: str | None = _field(f"{ADDITIONAL_CONFIG_KEY}.torchair_cache_dir", min_length=1)

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
