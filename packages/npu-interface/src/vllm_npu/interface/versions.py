# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The interface version and the range checks every component goes through.

``INTERFACE_VERSION`` is the version of the *contract* in this package (component protocol, device selection, config
schema, errors), not of the ``npu-interface`` distribution. A component declares the interface range it was written
against (``">=1.0,<2"``); a minor bump adds to the contract, a major bump breaks it.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

# packaging is imported by the functions below, not here: every layer's ``_component`` reads SUPPORTED_VLLM, and
# vLLM imports those modules in every process (also on hosts where our platform stays inactive).

INTERFACE_VERSION = "1.1"

#: The vLLM releases this plugin line is tested on (``TESTED_RELEASES`` in :mod:`.vllm_line`): the ``vllm`` range of
#: every component of the line. Any other vLLM is refused at plugin load (``VLLM_NPU_ALLOW_UNTESTED_VLLM=1`` overrides).
SUPPORTED_VLLM = ">=0.11.0,<=0.11.2"


def parse_range(spec: str, *, what: str) -> SpecifierSet:
    """Parse a PEP 440 range, naming ``what`` it belongs to when it is malformed."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(spec)
    except InvalidSpecifier as exc:
        raise ValueError(f"{what}: {spec!r} is not a PEP 440 version range (e.g. '>=1.0,<2')") from exc


def in_range(version: str, spec: str, *, what: str) -> bool:
    """Whether ``version`` lies in ``spec``. Pre-releases and local versions (``0.11.0+cpu``) count as their release."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return parse_range(spec, what=what).contains(Version(v.base_version), prereleases=True)


def release_key(version: str) -> tuple[int, ...]:
    """``"0.11.2"`` (or ``"0.11.2+cpu"``, ``"0.12.0rc1"``) -> ``(0, 11, 2)``: release order without packaging, for
    tables keyed on the first release of a change (the surface tables' and patches' ``changes``)."""
    parts: list[int] = []
    for part in version.split("+")[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(parts)


def distribution_version(dist: str) -> str | None:
    """The installed version of a distribution, or None. Reads metadata only: never imports the package."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class RangeCheck:
    """One range check: ``subject`` needs ``required`` of ``target`` and found ``found`` (None = not installed)."""

    subject: str
    target: str
    required: str
    found: str | None

    @property
    def ok(self) -> bool:
        return self.found is not None and in_range(self.found, self.required, what=f"{self.subject} -> {self.target}")

    def __str__(self) -> str:
        found = self.found if self.found is not None else "not installed"
        return f'{self.subject} requires {self.target} "{self.required}" but found {found}'
