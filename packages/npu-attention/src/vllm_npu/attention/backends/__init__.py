# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM attention backends of the Ascend plugin (GQA/MHA here; MLA and SFA in their own modules)."""
