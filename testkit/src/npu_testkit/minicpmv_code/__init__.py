# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The "remote code" of the tiny MiniCPM-V 2.6 checkpoints :mod:`npu_testkit.minicpmv_models` builds: config, image
processor and processor classes, copied into each model dir and named in its ``auto_map`` (``trust_remote_code``),
so transformers and vLLM load them without the hub.

Written here from the documented behaviour of MiniCPM-V 2.6 (LLaVA-UHD slicing, the ``(<image>./</image>)`` prompt
pattern, per-slice placeholders of ``query_num`` ``<unk>`` tokens) and from what vLLM 0.11's ``minicpmv.py`` calls,
not copied from the hub repository. Each file is self-contained (transformers imports each one on its own).
"""

#: The files copied into a model dir.
REMOTE_CODE_FILES = ("configuration_minicpm.py", "image_processing_minicpmv.py", "processing_minicpmv.py")
