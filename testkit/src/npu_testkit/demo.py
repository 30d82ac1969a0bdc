# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The demo's trained checkpoint, trained once per machine for the tests that run the demo or the selftest.

``vllm-npu demo`` and ``vllm-npu selftest`` train the demo model on first use (300 AdamW steps, ~26 CPU-s on an idle
host) into ``$VLLM_NPU_CACHE_DIR``. Each test runs them with a private cache dir, so every such test trained it
again. :func:`seed_demo_model` trains it once in the testkit's cache with the product's own ``ensure_demo_model``
(the same training, the same content key) and links it into a test's cache dir, where the demo finds it complete.
"""

from __future__ import annotations

import os
from pathlib import Path

from .cache import _locked
from .engine import patched_environ
from .models import default_cache_dir


def seed_demo_model(npu_cache_dir: str | os.PathLike[str]) -> Path:
    """Link the demo checkpoint (trained now if this machine has none) into ``npu_cache_dir`` under the name the
    demo looks for; returns the link. The first caller trains; concurrent callers wait for it."""
    from vllm_npu.platform.tools.demo import checkpoint

    shared = default_cache_dir() / "npu-demo"
    with patched_environ({"VLLM_NPU_CACHE_DIR": str(shared)}):
        target = checkpoint.demo_model_dir()
        with _locked(target):  # one training per machine, not one per xdist worker
            checkpoint.ensure_demo_model()
    link = Path(npu_cache_dir) / target.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)
    return link
