# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool on the Mooncake store (:class:`.connector.MooncakeStoreConnector`); see ``docs/kv-pool.md``."""
