# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Where CANN (Ascend's toolkit: drivers' user space, operator library, compiler) is installed: the one detector.

The device probe (:func:`vllm_npu.interface.device.probe_npu`) counts CANN as installed exactly when this finds a
home, and ``vllm-npu doctor`` reports that same home (and reads CANN's version from it), so the two can never
disagree. Reads the environment and the file system only; on vLLM's start-up path, so it imports nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

#: The variables CANN's set_env.sh exports that name its home, most specific first.
CANN_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
#: set_env.sh also exports the operator library path, ``<home>/opp``: its parent is the home.
CANN_OPP_VAR = "ASCEND_OPP_PATH"
#: Where CANN lives when no variable says so: the toolkit layout up to CANN 8.3 (its ``latest`` link first), then
#: the 8.5 layout.
CANN_DEFAULT_HOMES = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/ascend-toolkit",
    "/usr/local/Ascend/cann",
)


class CannHome(NamedTuple):
    """The CANN home found (an existing directory), or None; ``source`` is the variable that named it or
    ``"default location"``; ``searched`` lists every candidate in the order tried."""

    home: str | None
    source: str | None
    searched: tuple[str, ...]


def find_cann_home(
    environ: Mapping[str, str] | None = None, default_homes: tuple[str, ...] = CANN_DEFAULT_HOMES
) -> CannHome:
    """The first existing directory among :data:`CANN_HOME_VARS`, the parent of ``ASCEND_OPP_PATH`` and
    ``default_homes``. A variable naming a directory that does not exist does not count: torch_npu could not load
    CANN from it either."""
    environ = os.environ if environ is None else environ
    candidates = [(environ[var], var) for var in CANN_HOME_VARS if environ.get(var)]
    if environ.get(CANN_OPP_VAR):
        candidates.append((os.path.dirname(os.path.normpath(environ[CANN_OPP_VAR])), CANN_OPP_VAR))
    candidates += [(home, "default location") for home in default_homes]
    searched = tuple(home for home, _ in candidates)
    for home, source in candidates:
        if os.path.isdir(home):
            return CannHome(home, source, searched)
    return CannHome(None, None, searched)
