"""``python -m vllm_npu.platform.cli`` = ``vllm-npu``."""

import sys

from . import main

sys.exit(main())
