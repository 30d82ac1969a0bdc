# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The emulated device's static graphs, imported only on the emulated device: the graph twin (:mod:`.twin`: capture by
tracing, replay with address checks), its inductor compile (:mod:`.twin_compile`, :mod:`.twin_pieces`) and the torchair
mode's stand-in backend (:mod:`.standin`). Importing this package costs nothing."""
