"""Private test support for vllm-npu-plugin: see the package README."""
