# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Offline tooling of the platform wheel, never imported while serving: the ``vllm-npu`` command (:mod:`.cli`:
doctor, selftest and the subcommand table) and the demo model (:mod:`.demo`). Importing this package costs nothing."""
