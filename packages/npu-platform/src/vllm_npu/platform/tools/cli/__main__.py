# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``python -m vllm_npu.platform.tools.cli`` = ``vllm-npu``."""

import sys

from . import main

sys.exit(main())
