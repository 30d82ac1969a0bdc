# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Whether vLLM can take audio the way a served audio model receives it, and the warning when it cannot.

vLLM 0.11 decodes audio given as bytes with librosa (``vllm/multimodal/audio.py``: ``librosa.load`` for the
``input_audio`` / ``audio_url`` chat parts; ``librosa.resample`` for every waveform given with its sample rate,
even the processor's own), and leaves librosa to its optional ``audio`` extra. Without it every such request is vLLM's HTTP 500
"Please install vllm[audio] for audio support" while the rest of the server works, so the gap shows only with the
first user's audio. npu-models' ``audio`` extra (through ``npu-platform[audio]``) installs librosa; an audio model
built without it logs :func:`missing_audio_decoder`'s message once per process at model build, naming that line.
(vllm-ascend v0.11.0 ships no extra: its FAQ tells Qwen2.5-Omni users to ``pip install qwen-omni-utils`` for
librosa.)
"""

from __future__ import annotations

import importlib.util
from typing import Any

from vllm_npu.interface import get_logger, once

logger = get_logger(__name__)

#: What installs the audio decoder the way users install the plugin.
AUDIO_INSTALL = 'pip install "npu-platform[audio]"'
#: The module vLLM's audio loading and resampling import.
AUDIO_DECODER = "librosa"


def missing_audio_decoder(arch: str) -> str | None:
    """The warning for serving ``arch`` (an audio-input architecture) here, or None when librosa is importable."""
    if importlib.util.find_spec(AUDIO_DECODER) is not None:
        return None
    return (
        f"{arch} takes audio, but {AUDIO_DECODER} (vLLM's optional audio decoder) is not installed: requests with "
        "input_audio / audio_url parts or (waveform, sample rate) pairs will fail with HTTP 500 / ImportError "
        '"Please install vllm[audio] for audio support"; only bare waveforms at the model\'s rate work. Fix: '
        f"{AUDIO_INSTALL}"
    )


def warn_without_audio_decoder(arch: str, vllm_config: Any) -> bool:
    """Log :func:`missing_audio_decoder`'s warning once per process, unless ``vllm_config`` turns audio off
    (``--limit-mm-per-prompt '{"audio": 0}'``); returns whether it was logged now."""
    mm_config = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm_config is not None and mm_config.get_limit_per_prompt("audio") == 0:
        return False
    message = missing_audio_decoder(arch)
    if message is None:
        return False
    return once(f"vllm_npu.models.audio_input:{arch}", lambda: logger.warning("%s", message))
