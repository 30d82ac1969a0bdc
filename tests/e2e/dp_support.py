# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Running an offline data-parallel engine on the emulated device, one process per DP rank (``dp_rank.py``), as
vLLM runs offline data parallel (``VLLM_DP_*`` variables; each rank's engine core in its process). Shared by the DP
e2e modules; not a test module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from npu_testkit.engine import emulated_env
from npu_testkit.serve import free_port

TIMEOUT_S = 900


def run_dp(
    model: Path,
    llm_kwargs: dict,
    tmp: Path,
    shares: dict[int, list[list[int]]],
    max_tokens: int,
    *,
    multiprocessing: bool = False,
    late_shares: dict[int, list[list[int]]] | None = None,
    **request: Any,
) -> dict[int, dict]:
    """Greedy ``max_tokens`` for each DP rank's prompts (``shares``: rank -> its token prompts); ``request`` adds keys
    to each rank's request (``dp_rank.py``). ``late_shares`` (rank -> prompts, possibly none): a second generate
    after the first on every rank (a rank without late prompts steps dummy batches meanwhile). Returns each rank's
    output JSON.

    By default each rank's engine core runs in its rank's process (vLLM's LLMEngine then joins the DP group itself):
    two processes, not four. ``multiprocessing=True`` gives each rank vLLM's engine-core process (``DPEngineCoreProc``,
    which steps dummy batches itself); speculative decoding needs it, since vLLM 0.11 hands the drafted tokens to the
    scheduler only from the engine-core busy loop (``EngineCore.post_step``)."""
    # the engine-core process takes dp_rank.py's worker functions through collective_rpc: pickled (test code only)
    extra = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if multiprocessing else None
    env = {**os.environ, **emulated_env(tmp, multiprocessing=multiprocessing, extra=extra)}
    port = free_port()
    procs = {}
    for rank, prompts in shares.items():
        path = tmp / f"request{rank}.json"
        late = {} if late_shares is None else {"late_prompts": late_shares[rank]}
        path.write_text(
            json.dumps({"prompts": prompts, "max_tokens": max_tokens, "llm": llm_kwargs, **late, **request})
        )
        dp_env = {
            **env,
            "VLLM_DP_RANK": str(rank),
            "VLLM_DP_RANK_LOCAL": str(rank),
            "VLLM_DP_SIZE": str(len(shares)),
            "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(port),
        }
        cmd = [sys.executable, str(Path(__file__).with_name("dp_rank.py")), str(model), str(path)]
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below, after the process ends)
        procs[rank] = (subprocess.Popen([*cmd, str(tmp / f"out{rank}.json")], env=dp_env, stdout=log, stderr=log), log)
    try:
        codes: dict[int, int | None] = {}
        for rank, (proc, log) in procs.items():
            # After one rank failed the others end on the broken connection ("Connection closed by peer"), the cause
            # sits in the failed rank's log: wait for them briefly and report every failed rank.
            try:
                codes[rank] = proc.wait(timeout=TIMEOUT_S if all(rc == 0 for rc in codes.values()) else 60)
            except subprocess.TimeoutExpired:
                codes[rank] = None  # killed below
            log.close()
        failed = [
            f"DP rank {r} {'hung' if rc is None else f'exited with {rc}'}:\n{(tmp / f'rank{r}.log').read_text()[-4000:]}"
            for r, rc in codes.items()
            if rc != 0
        ]
        assert not failed, "\n".join(failed)
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return {rank: json.loads((tmp / f"out{rank}.json").read_text()) for rank in shares}
