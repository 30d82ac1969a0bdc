# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Render the patch registry as docs/patches.md. Deterministic: depends on the declarations only, never on the
environment, so a test can compare the committed file with the registry."""

from __future__ import annotations

from ._registry import PatchRegistry

_HEADER = """\
<!-- Generated from the npu-patches registry: `vllm-npu patches --markdown --output docs/patches.md`.
     Do not edit by hand; packages/npu-patches/tests/test_docs_and_cli.py fails when this file and the registry differ. -->
# Patches applied to vLLM

vllm-npu-plugin changes no line of vLLM. Where vLLM offers no seam, it monkey-patches through one registry
(`vllm_npu.patches`), and every patch declares its target, scope, vLLM range, upstream reference, reason, removal
plan and the fingerprint of the code it replaces:

- **scope** `platform` = every process where the plugin's platform is active, at plugin load; `worker` = each worker
  process, at worker init.
- Outside its vLLM range a patch is skipped (logged). Inside it, a changed target fails loudly at start-up naming the
  patch (`PatchFingerprintError`) instead of patching code it was not written for.
- Disable patches with `VLLM_NPU_PATCHES=-<id>[,-<id>...]` (or `none`), or
  `--additional-config '{"npu": {"disabled_patches": ["<id>"]}}'` (worker patches). Unknown ids are an error.
- `vllm-npu patches` shows each patch's status in your environment.

"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_markdown(registry: PatchRegistry) -> str:
    """The full docs page for ``registry``'s patches plus the candidates deliberately not patched."""
    from .sets import NOT_PATCHED

    lines = [_HEADER.rstrip("\n"), "", f"## Patches ({len(registry.patches())})", ""]
    lines.append("| id | target | scope | vLLM | why | upstream | removal |")
    lines.append("|---|---|---|---|---|---|---|")
    for p in registry.patches():
        lines.append(
            f"| `{p.id}` | `{p.target}` | {p.scope.value} | `{p.vllm}` | {_cell(p.reason)} | {_cell(p.upstream)} "
            f"| {_cell(p.removal)} |"
        )
    lines += ["", "## Looked at and not patched", "", "| candidate | why no patch |", "|---|---|"]
    lines += [f"| {_cell(what)} | {_cell(why)} |" for what, why in NOT_PATCHED]
    return "\n".join(lines) + "\n"
