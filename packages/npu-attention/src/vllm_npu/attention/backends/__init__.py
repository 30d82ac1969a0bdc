"""vLLM attention backends of the Ascend plugin (GQA/MHA here; MLA and SFA in their own modules)."""
