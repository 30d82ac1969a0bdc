#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The system libraries the test suite needs beyond the uv environment, installed where this script can.

The emulated-device build of the Mooncake transfer engine (``mooncake-transfer-engine-non-cuda``, npu-kv's transport,
in the workspace's dev group) is a binary wheel whose ``engine.so`` links against libraries it does not bundle:
``libibverbs.so.1``, ``libnuma.so.1`` and ``libcurl.so.4`` (``readelf -d``; everything else it needs is in
``mooncake_transfer_engine_non_cuda.libs``). ``librdmacm.so.1`` (RDMA connection management) is no link
dependency of the wheel's binaries today; it stays in the list the project has installed since npu-kv landed, for the
RDMA transport on hosts that have RDMA devices. Without them ``import mooncake.engine`` fails with
``libibverbs.so.1: cannot open shared object file`` and every npu-kv transfer test and prefill-decode e2e test with it.

Usage (the README's test command runs the first form before pytest; so does ``.ci/run``):
  python3 scripts/system_libs.py           install the missing ones as root (or with passwordless sudo) through
                                           apt-get; where it cannot, print the exact command to run and exit 0, so
                                           pytest still runs: the tests that need them then fail with that message
  python3 scripts/system_libs.py --check   exit 1 with that message when any is missing (installs nothing)

Standard library only: it runs before uv has created the environment.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

# soname the Mooncake binaries load -> the Debian 12 / Ubuntu 22.04 package that ships it. Debian 13 and Ubuntu 24.04
# renamed some in the 64-bit time_t transition (libcurl4t64, librdmacm1t64), whose packages provide the old names, so
# apt-get resolves these (checked on Debian 12 only).
LIBRARIES: dict[str, str] = {
    "libibverbs.so.1": "libibverbs1",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
NEEDED_BY = "the Mooncake transfer engine (npu-kv's transfer tests and the prefill-decode e2e tests)"


def apt_command(packages: Sequence[str]) -> str:
    """The one line that installs ``packages`` on Debian/Ubuntu, as root."""
    return f"apt-get update && apt-get install -y --no-install-recommends {' '.join(packages)}"


def loads(soname: str) -> bool:
    """Whether the dynamic loader finds ``soname`` (the same lookup ``import mooncake.engine`` makes)."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def missing(probe: Callable[[str], bool] = loads) -> list[str]:
    """The sonames of ``LIBRARIES`` the loader cannot find, in table order."""
    return [soname for soname in LIBRARIES if not probe(soname)]


def message(sonames: Sequence[str]) -> str:
    """What is missing, who needs it and the exact command that fixes it."""
    packages = [LIBRARIES[s] for s in sonames]
    return (
        f"missing system libraries {', '.join(sonames)}, needed by {NEEDED_BY}; install them as root: "
        f"{apt_command(packages)}   (or run `python3 scripts/system_libs.py` as root; on a distribution without "
        "apt-get install the packages that ship these sonames)"
    )


def _privilege(
    euid: int, which: Callable[[str], str | None], run: Callable[..., subprocess.CompletedProcess]
) -> list[str] | None:
    """The prefix that runs apt-get as root: [] as root, sudo with passwordless sudo, None otherwise."""
    if euid == 0:
        return []
    if which("sudo") and run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    return None


def main(
    argv: Sequence[str] | None = None,
    *,
    probe: Callable[[str], bool] = loads,
    euid: int | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a library is missing; install nothing")
    args = parser.parse_args(argv)
    absent = missing(probe)
    if not absent:
        print(f"system libraries: all present ({', '.join(LIBRARIES)})")
        return 0
    if args.check:
        print(message(absent), file=sys.stderr)
        return 1
    prefix = _privilege(os.geteuid() if euid is None else euid, which, run)
    if prefix is None or not which("apt-get"):
        why = "not root and no passwordless sudo" if prefix is None else "no apt-get on this machine"
        print(f"system_libs.py cannot install ({why}): {message(absent)}", file=sys.stderr)
        return 0
    packages = [LIBRARIES[s] for s in absent]
    print(f"system libraries: installing {' '.join(packages)} for {', '.join(absent)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        if run([*prefix, *command], env=env).returncode != 0:
            print(f"system_libs.py: `{' '.join(command)}` failed: {message(absent)}", file=sys.stderr)
            return 1
    still = missing(probe)
    if still:
        print(f"system_libs.py: installed, yet the loader does not find them: {message(still)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
