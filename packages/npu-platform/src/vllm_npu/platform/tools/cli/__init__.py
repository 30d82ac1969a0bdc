# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ``vllm-npu`` command (console script ``vllm_npu.platform.tools.cli:main``).

Subcommands are a table of ``"module:function"`` strings (:data:`SUBCOMMANDS`): nothing is imported until one runs,
so ``vllm-npu --help`` imports neither torch nor vLLM. A subcommand's function takes its own argument list
(``main(argv: list[str]) -> int | None``) and parses it itself. A subcommand that lives in a layer which is not
installed prints the pip command that installs it and exits with status 2.

To add a subcommand, add a row to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..._version import __version__

#: Exit status when a subcommand cannot run because its layer (or its module) is not installed.
EXIT_MISSING = 2


@dataclass(frozen=True)
class Subcommand:
    """One ``vllm-npu`` subcommand: ``target`` is ``"module:function"``, ``layer`` the component that ships it."""

    target: str
    layer: str
    help: str

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]


SUBCOMMANDS: dict[str, Subcommand] = {
    "doctor": Subcommand(
        "vllm_npu.platform.tools.cli.doctor:main",
        "platform",
        "check this installation: vLLM/torch/torch_npu/CANN versions, device mode and why, components, what is missing",
    ),
    "demo": Subcommand(
        "vllm_npu.platform.tools.demo:main",
        "platform",
        "generate text with a tiny model through real vLLM (the emulated device on a CPU host)",
    ),
    "selftest": Subcommand(
        "vllm_npu.platform.tools.cli.selftest:main",
        "platform",
        "run every NPU kernel against its reference twin on this host, then a short generate (after doctor)",
    ),
    "patches": Subcommand(
        "vllm_npu.patches.cli:main",
        "patches",
        "list the vLLM patches (vLLM range, upstream PR, removal plan) and whether each applies here",
    ),
    "quantize": Subcommand(
        "vllm_npu.quant.tools.cli:main",
        "quant",
        "tools for msModelSlim-quantized checkpoints (the ascend quant method)",
    ),
    "pd-proxy": Subcommand(
        "vllm_npu.kv.cli:main",
        "kv",
        "serve the OpenAI-compatible proxy in front of prefill and decode instances (PD disaggregation)",
    ),
    "kv-pool": Subcommand(
        "vllm_npu.kv.pool.cli:main",
        "kv",
        "start a KV pool (mooncake_master + a client lending host memory) for the MooncakeStoreConnector",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-npu",
        description="Ascend NPU plugin for vLLM: diagnostics and tools.",
        epilog="Run 'vllm-npu <command> --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"npu-platform {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="<command>", dest="command")
    for name, sub in SUBCOMMANDS.items():
        commands.add_parser(name, help=sub.help, add_help=False)
    return parser


def _missing(name: str, sub: Subcommand) -> int:
    from vllm_npu.interface import LAYER_DISTRIBUTIONS, MissingComponentError, distribution_version

    if importlib.util.find_spec(f"vllm_npu.{sub.layer}") is None:
        print(
            f"vllm-npu: {MissingComponentError(sub.layer, f'`vllm-npu {name}` needs the {sub.layer} layer')}",
            file=sys.stderr,
        )
    else:
        dist = LAYER_DISTRIBUTIONS.get(sub.layer, sub.layer)
        print(
            f"vllm-npu: `vllm-npu {name}` needs {sub.module}, which {dist} "
            f"{distribution_version(dist) or '(unknown version)'} does not provide; upgrade it: pip install -U {dist}",
            file=sys.stderr,
        )
    return EXIT_MISSING


def _resolve(sub: Subcommand) -> Callable[[list[str]], int | None] | None:
    """The subcommand's function, or None when its module is not installed."""
    try:
        if importlib.util.find_spec(sub.module) is None:
            return None
    except ModuleNotFoundError:  # a parent package is missing
        return None
    from vllm_npu.interface import import_target

    func: Callable[[list[str]], int | None] = import_target(sub.target, what="vllm-npu subcommand")
    return func


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vllm-npu``. Returns the exit status (the console script exits with it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        name, rest = args[0], args[1:]
        sub = SUBCOMMANDS[name]
        func = _resolve(sub)
        if func is None:
            return _missing(name, sub)
        status = func(rest)
        return int(status or 0)
    parser = _parser()
    parsed = parser.parse_args(args)  # handles --help/--version; exits 2 on an unknown command
    if parsed.command is None:
        parser.print_help()
        return EXIT_MISSING
    raise AssertionError(f"unreachable: {parsed.command}")


if __name__ == "__main__":
    sys.exit(main())
