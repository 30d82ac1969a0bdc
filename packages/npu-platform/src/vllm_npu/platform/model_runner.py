# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner: vLLM's ``GPUModelRunner`` with the device-specific calls mapped to the active device.

Everything else (input preparation, the persistent batch, chunked prefill, prefix caching, async scheduling,
sampling and logprobs, KV-cache allocation) is vLLM's own code. The overrides:

- ``__init__`` runs inside :func:`._device.cuda_stream_api_as`, and so does ``execute_model`` under async
  scheduling: vLLM creates ``torch.cuda.Stream``/``Event`` objects there (eagerly in ``__init__``; per step in
  ``AsyncGPUModelRunnerOutput``). Within those calls the CUDA stream API is the device's: ``torch.npu`` on an NPU,
  no-op in-order stream/event objects on the emulated device. Objects created there keep working afterwards (they
  are the device's own), so the shim never needs to be process-wide. Dual-batch overlap (``--enable-dbo``) is
  refused by the platform: vLLM's ``UBatchWrapper`` calls ``torch.cuda`` in ``load_model`` and in its threads,
  outside this shim, and asserts a CUDA platform.
- ``execute_model`` / ``_sample``: structured output's grammar bitmask is applied by :mod:`.sample.grammar` (on the
  device on an NPU; xgrammar's CPU kernel on float32 copies of the structured rows on the emulated device: vLLM's own
  call fails for bf16/fp16 logits on the host), and one request's failing logits processing (its bitmask row, its
  per-request logits processor) is reported with the step's output for the scheduler to fail that request alone.
- top-k / top-p: vLLM's ``TopKTopPSampler`` is replaced by :class:`.sample.NPUTopKTopPSampler` (the NPU's
  ``npu_top_k_top_p`` within its k range, else a sort; vLLM's seeded ``random_sample`` unchanged); ``_sample`` tells
  it the step's largest k from the persistent batch's host copy, so the choice reads no device tensor.
- ``_preprocess``: the positions of a step's padding tokens (graphs pad a step to a capture size) are zeroed every
  step, as vllm-ascend's runner does, so a model that adds to its positions in place (RoBERTa) cannot push the
  stale padding slots past its position table (vllm#37868).
- ``_init_device_properties`` and ``_sync_device``: the device's, instead of ``torch.cuda``'s.
- ``eplb_step`` (vLLM's ``--enable-eplb``): vLLM's own step (``EplbState.step``: load window, and every
  ``eplb_config.step_interval`` steps the rearrangement over the EP group), run inside
  :func:`._device.cuda_synchronize_as` because vLLM's rearrangement calls ``torch.cuda.synchronize``. vLLM's
  ``load_model`` builds the ``EplbState`` and ``execute_model`` / ``_dummy_run`` call this method, as on CUDA.
  ``_dummy_run`` then zeroes the pass load, so that no dummy forward (profile run, warm-up) counts as load.
- ``_dummy_run`` (vLLM 0.11.0) runs the model at the data-parallel ranks' padded count (vLLM pads only the counts;
  0.11.1 runs at it itself): vLLM's DP dummy batch of a rank without requests then holds as many rows as the other
  ranks' step (the MoE exchange, a graph captured at that size).
- speculative decoding: vLLM's ``RejectionSampler`` (built in ``__init__`` only with a speculative config on the
  last pipeline rank) launches Triton kernels; it is replaced by :class:`.sample.NPURejectionSampler`, the same
  contract in torch.
- static graphs (:mod:`.graphs`): ``load_model`` puts :class:`.graphs.wrapper.NPUGraphWrapper` around the model
  where vLLM put its CUDA wrapper (FULL_DECODE_ONLY); ``capture_model`` is vLLM's capture loop (warm-up and capture
  per size, largest first, so smaller graphs reuse the pool) with memory, streams and sync from the device backend,
  and without vLLM's ``graph_capture`` context (it asserts a CUDA communicator under tensor parallelism). With
  ``npu.graph_mode='torchair'`` the wrapper is :class:`.graphs.torchair.TorchairWrapper`, and the same loop compiles
  each decode size instead of capturing it.
- ``initialize_kv_cache_tensors``: when several cache layers share a decoder-layer index (DeepSeek-V3.2: the MLA
  latent cache ``...self_attn.attn`` and the indexer key cache ``...self_attn.indexer.k_cache``), vLLM 0.11's
  ``bind_kv_cache`` raises ``NotImplementedError`` on every platform but CUDA/XPU. The override binds them the
  CUDA way (``self.kv_caches`` keeps the first cache of each layer index, every layer's forward-context entry gets
  its own cache); with one cache layer per index it is vLLM's method unchanged.
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput, GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache
from vllm_npu.interface import get_logger, report_request_faults

from ._device import _torch_npu, cuda_stream_api_as, cuda_synchronize_as, device_backend
from .graphs.config import stream_budget
from .graphs.dp_pad import dummy_runs_every_pass
from .graphs.sizes import GraphStreamsExhaustedError, is_stream_exhaustion, stream_exhaustion_message
from .graphs.torchair import DraftTorchairWrapper, TorchairWrapper, torchair_enabled
from .graphs.wrapper import GRAPH_STATS, NPUGraphWrapper, engine_wrappers
from .kv_no_forward import kv_connector_no_forward

# Resolved once here, not per step: a function-level ``from .sample import name`` goes through the door's lazy
# ``__getattr__`` (an import-system lookup) twice per name on every step (~18 us a step, issue 35).
from .sample.grammar import apply_grammar_bitmask, async_scheduling_faults
from .sample.request_faults import isolated_request_logitsprocs
from .sample.topk_topp import NPUTopKTopPSampler

logger = get_logger(__name__)

# Smallest emulated profile run (tokens): a few prefill chunks' worth, enough to run every kernel path of a batch.
EMULATED_PROFILE_MIN_TOKENS = 256

#: vLLM 0.11.1 split sampling out of ``execute_model`` into ``sample_tokens(grammar_output)`` (read off the class).
SPLIT_SAMPLING = hasattr(GPUModelRunner, "sample_tokens")
#: vLLM 0.11.0's ``_dummy_run`` pads only the data-parallel counts (``get_dp_padding``) and runs the model at its own
#: ``num_tokens``; from 0.11.1 (``coordinate_batch_across_dp``, no ``get_dp_padding``) it runs at the padded count.
DUMMY_RUN_PADS_ONLY_DP_COUNTS = hasattr(GPUModelRunner, "get_dp_padding")
#: vLLM 0.11.1 captures graphs per (num_tokens, activate_lora) case (``_dummy_run`` gained ``activate_lora`` with it).
CAPTURE_CASES_WITH_LORA = "activate_lora" in inspect.signature(GPUModelRunner._dummy_run).parameters
#: vLLM 0.11.1 resolves the graph mode when it builds the attention backends, no longer before capture.
MODE_RESOLVED_AT_BACKEND_INIT = not hasattr(GPUModelRunner, "initialize_cudagraph_capture")
#: vLLM 0.11.1's ``_preprocess`` takes the step's padded token count (``num_input_tokens``) and returns the model's
#: inputs only; 0.11.0's pads itself and returns ``(num_scheduled_tokens, num_input_tokens, ...)`` first.
PREPROCESS_TAKES_NUM_INPUT = "num_input_tokens" in inspect.signature(GPUModelRunner._preprocess).parameters


class NPUModelRunner(GPUModelRunner):
    #: vLLM's process-wide ``num_cudagraph_captured`` when this runner was built (its captures are counted from here).
    cudagraph_captured_before: int

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.device_backend = device_backend()
        # Graph counts of this engine: vLLM's capture counter is process-wide, so remember where it stood.
        GRAPH_STATS.reset()
        self.cudagraph_captured_before = compilation_counter.num_cudagraph_captured
        with cuda_stream_api_as(self.device_backend):
            super().__init__(vllm_config, device)
        if hasattr(self, "rejection_sampler"):
            from .sample.rejection_sampler import make_rejection_sampler

            self.rejection_sampler = make_rejection_sampler(getattr(self, "sampler", None))
        if hasattr(self, "sampler"):
            self.sampler.topk_topp_sampler = NPUTopKTopPSampler(self.sampler.logprobs_mode)
        from .sample import GRAMMAR_BITMASK

        #: The structured-output mask, chosen once: on the device on an NPU, xgrammar's CPU kernel otherwise.
        self.grammar_mask = GRAMMAR_BITMASK.select()

    def _make_buffer(self, *size: int | torch.SymInt, dtype: torch.dtype, numpy: bool = True) -> CpuGpuBuffer:
        """vLLM's host/device buffer pair. On the emulated device the device half is its own tensor: vLLM's
        ``CpuGpuBuffer`` makes it with ``cpu.to(device)``, which for a CPU device returns the host tensor itself, and
        code that updates both halves would then update one tensor twice (EAGLE/MTP drafting does
        ``seq_lens += 1; seq_lens_cpu += 1`` per draft position on the two halves of one buffer)."""
        buffer = super()._make_buffer(*size, dtype=dtype, numpy=numpy)
        if buffer.gpu.data_ptr() == buffer.cpu.data_ptr():
            buffer.gpu = buffer.cpu.clone()
        return buffer

    def _init_device_properties(self) -> None:
        if self.device_backend.type == "npu":
            self.device_properties = _torch_npu().get_device_properties(self.device)
            # AI-core count: the NPU's analogue of the SM count (0 if this torch_npu does not report it); vLLM reads
            # it only to decide on cascade attention, which the NPU platform disables.
            self.num_sms = int(getattr(self.device_properties, "cube_core_num", None) or 0)
        else:
            self.device_properties = None  # type: ignore[assignment]  # vLLM types it as CUDA's; no device here
            self.num_sms = 0

    def _sync_device(self) -> None:
        self.device_backend.synchronize(self.device)

    def emulated_profile_tokens(self) -> int:
        """Tokens of the emulated device's profile run: every request slot (``max_num_seqs``, so the sampler runs
        at its full batch) and at least :data:`EMULATED_PROFILE_MIN_TOKENS`, capped at ``max_num_batched_tokens``."""
        return min(self.max_num_tokens, max(self.max_num_reqs, EMULATED_PROFILE_MIN_TOKENS))

    def profile_run(self) -> None:
        """vLLM's profile run on the NPU. On the emulated device a smaller one, without the full collection.

        On an NPU the profile run is a measurement: one forward of ``max_num_batched_tokens`` tokens (vLLM's
        8192 for the offline ``LLM``) whose allocator peak sizes the KV cache, then ``gc.collect()``. The emulated
        device's KV budget is fixed (``VLLM_NPU_EMULATED_KV_CACHE_GB``) and no peak is read, so the run only proves
        that a forward and the sampler work on an engine-shaped batch before serving; its size buys nothing but
        host time (an 8192-token forward of the reference kernels, then a ~0.5 s collection). vLLM's CPU backend
        skips the profile run entirely and warms up with ``max(16, max_num_seqs)`` tokens; the emulated run keeps
        every request slot (:meth:`emulated_profile_tokens`). Multimodal models keep vLLM's run, which also runs the vision
        encoder on its largest batch."""
        if self.device_backend.type == "npu" or self.supports_mm_inputs:
            return super().profile_run()
        hidden_states, last_hidden_states = self._dummy_run(self.emulated_profile_tokens(), is_profile=True)
        if get_pp_group().is_last_rank:
            if self.is_pooling_model:
                self._dummy_pooler_run(hidden_states)
            else:
                self._dummy_sampler_run(last_hidden_states)
        self._sync_device()

    def eplb_step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        if not self.parallel_config.enable_eplb:
            return
        with cuda_synchronize_as(self.device_backend):
            super().eplb_step(is_dummy, is_profile)

    #: vLLM 0.11.0: the DP counts :meth:`_dummy_run` exchanged for the run in progress (see :meth:`get_dp_padding`).
    _dp_counts_taken: tuple[int, torch.Tensor | None] | None = None

    def get_dp_padding(self, num_tokens: int) -> tuple[int, torch.Tensor | None]:
        """vLLM 0.11.0's count exchange; inside :meth:`_dummy_run`, the counts it already exchanged for that run (so
        vLLM's own call there is no second all-reduce)."""
        if self._dp_counts_taken is not None:
            return self._dp_counts_taken
        return super().get_dp_padding(num_tokens)

    def _dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if DUMMY_RUN_PADS_ONLY_DP_COUNTS:
            # vLLM 0.11.0 pads a dummy run's DP counts to the largest rank's (get_dp_padding) but hands the model
            # num_tokens rows: its DP dummy batch (execute_dummy_batch: one row) beside another rank's step met the MoE
            # exchange, and a graph captured at the padded size, with one row. As vllm-ascend
            # (worker/model_runner_v1.py:2397-2399) and vLLM 0.11.1, it runs at the DP-synced count: the counts are
            # taken here, by the run's one all-reduce, and handed to vLLM's _dummy_run (the collectives pair 1:1).
            num_pad, across_dp = self.get_dp_padding(num_tokens)
            self._dp_counts_taken = (0, across_dp)
            try:
                out = super()._dummy_run(num_tokens + num_pad, *args, **kwargs)
            finally:
                self._dp_counts_taken = None
        else:
            out = super()._dummy_run(num_tokens, *args, **kwargs)
        if self.eplb_state is not None:
            # vLLM drops a dummy run's expert load only in a non-profile eplb_step: the profile run and the
            # skip_eplb runs (warm-up, graph capture) would count in the next real step's window.
            self.eplb_state.expert_load_pass.zero_()
        return out

    def _preprocess(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = super()._preprocess(scheduler_output, *args, **kwargs)
        if PREPROCESS_TAKES_NUM_INPUT:  # vLLM 0.11.1: the padded count is its argument, the results are tensors
            num_scheduled = scheduler_output.total_num_scheduled_tokens
            num_input = args[0] if args else kwargs["num_input_tokens"]
        else:  # vLLM 0.11.0: the first two results are the scheduled and padded token counts
            num_scheduled, num_input = out[0], out[1]
        if num_input > num_scheduled and not self.uses_mrope:
            # vLLM refreshes only the scheduled tokens' positions; a graph pads the step to a capture size, and a
            # model that adds to its positions in place (RoBERTa's padding offset, replace_roberta_positions) would
            # add again to the stale padding slots every step until they overflow the position table
            # (vllm#37868). Zeroed padding, as vllm-ascend's runner keeps it (model_runner_v1.py:1366-1368).
            self.positions.gpu[num_scheduled:num_input].zero_()
        return out

    #: vLLM 0.11.0 drops a no-forward step's connector stats (see :mod:`.kv_no_forward`); 0.11.1's rule on every release.
    kv_connector_no_forward = staticmethod(kv_connector_no_forward)

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any | None = None) -> Any:
        if SPLIT_SAMPLING:
            # vLLM 0.11.1: the forward only; sampling (and the grammar bitmask) is sample_tokens' step.
            return self._step(lambda: super(NPUModelRunner, self).execute_model(scheduler_output, intermediate_tensors))
        # The grammar bitmask is applied by _sample (sample.grammar: every logits dtype, per-request faults), so
        # vLLM's own apply_grammar_bitmask must not see it; the scheduler's object gets it back afterwards.
        bitmask, scheduler_output.grammar_bitmask = scheduler_output.grammar_bitmask, None
        self._grammar_step = (scheduler_output, bitmask) if bitmask is not None else None
        try:
            return self._step(lambda: super(NPUModelRunner, self).execute_model(scheduler_output, intermediate_tensors))
        finally:
            scheduler_output.grammar_bitmask = bitmask
            self._grammar_step = None

    def sample_tokens(self, grammar_output: Any | None) -> Any:
        """vLLM 0.11.1's sampling step (it split sampling out of ``execute_model``). Its grammar bitmask goes to
        :meth:`_sample` as on 0.11.0 (vLLM's own ``apply_grammar_bitmask`` gets None)."""
        state = cast(Any, self).execute_model_state  # vLLM 0.11.1: the forward's state, None if nothing ran
        if grammar_output is not None and state is not None:
            # The scheduler's (request -> bitmask row) order and the step's draft tokens, as 0.11.0's SchedulerOutput
            # carried them for sample.grammar.structured_rows.
            step = SimpleNamespace(
                structured_output_request_ids={
                    r: i for i, r in enumerate(grammar_output.structured_output_request_ids)
                },
                scheduled_spec_decode_tokens=state[0].scheduled_spec_decode_tokens,
            )
            self._grammar_step = (step, grammar_output.grammar_bitmask)
        try:
            return self._step(lambda: cast(Any, super(NPUModelRunner, self)).sample_tokens(None))
        finally:
            self._grammar_step = None

    def _step(self, run: Callable[[], Any]) -> Any:
        """Run one vLLM step method, reporting the requests whose own logits processing failed on its output."""
        self._request_faults: dict[str, str] = {}
        # vLLM's execute_model makes CUDA streams/events only for async scheduling (AsyncGPUModelRunnerOutput;
        # dual-batch overlap would too, but the platform refuses it); otherwise the shim's swap of torch.cuda's
        # names is per-step cost for nothing (the events of __init__ were made under the shim already).
        if self.use_async_scheduling:
            with cuda_stream_api_as(self.device_backend):
                output = run()
        else:
            output = run()
        if self._request_faults and output is not None:
            # AsyncGPUModelRunnerOutput hands the scheduler its inner ModelRunnerOutput (get_output()).
            inner = output._model_runner_output if isinstance(output, AsyncGPUModelRunnerOutput) else output
            report_request_faults(inner, self._request_faults)
        return output

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        """vLLM's sampling step, after the structured-output bitmask (:func:`.sample.apply_grammar_bitmask`), with
        per-request logits processors guarded (:func:`.sample.isolated_request_logitsprocs`): a request whose own
        logits processing fails is recorded in ``_request_faults`` (reported with the step's output), not raised."""
        faults = getattr(self, "_request_faults", {})
        step = getattr(self, "_grammar_step", None)
        if step is not None and logits is not None:
            scheduler_output, bitmask = step
            batch = self.input_batch.req_id_to_index
            if self.use_async_scheduling:  # the bitmask is a token stale: fail those requests with the reason
                faults.update(async_scheduling_faults(scheduler_output, batch))
            else:
                faults.update(apply_grammar_bitmask(scheduler_output, bitmask, batch, logits, self.grammar_mask))
        with isolated_request_logitsprocs(self.input_batch, faults), self._host_top_k():
            return super()._sample(logits, spec_decode_metadata)

    def _host_top_k(self) -> AbstractContextManager[None]:
        """The step's largest top-k, read from the persistent batch's host copy (the one vLLM copies to the device
        ``top_k`` of the sampling metadata), for the top-k/top-p sampler to choose the NPU op without a device read."""
        topk_topp = getattr(getattr(self, "sampler", None), "topk_topp_sampler", None)
        if not isinstance(topk_topp, NPUTopKTopPSampler):
            return nullcontext()
        batch = self.input_batch
        k_max = None if batch.no_top_k or batch.num_reqs == 0 else int(batch.top_k_cpu[: batch.num_reqs].max())
        return topk_topp.host_top_k(k_max)

    def load_lora_model(self, model: nn.Module, vllm_config: VllmConfig, device: torch.device) -> nn.Module:
        """vLLM's ``load_lora_model`` with npu-ops' worker LoRA manager in place of vLLM's LRU one: the same manager
        plus a check of each adapter's tensor shapes against the model when it loads (vLLM checks none)."""
        from vllm.model_executor.models import supports_lora, supports_multimodal
        from vllm_npu.interface import require

        require("ops", "LoRA (--enable-lora) on the NPU is provided by the npu-ops layer")
        from vllm_npu.ops.lora import NPUWorkerLoRAManager

        if not supports_lora(model):
            raise ValueError(f"{model.__class__.__name__} does not support LoRA yet.")
        if supports_multimodal(model):
            logger.warning("for multimodal models vLLM adds LoRA to the language model only")
        self.lora_manager = NPUWorkerLoRAManager(
            vllm_config, device, model.embedding_modules, model.embedding_padding_modules
        )
        return self.lora_manager.create_lora_manager(model)

    # --- static graphs ------------------------------------------------------------------------------------------

    def load_model(self, eep_scale_up: bool = False) -> None:
        super().load_model(eep_scale_up)
        # vLLM types self.model as nn.Module but stores its CUDAGraphWrapper (not a Module) there: test it as an object.
        model: object = self.model
        wrapper_cls = TorchairWrapper if torchair_enabled(self.vllm_config) else NPUGraphWrapper
        if isinstance(model, CUDAGraphWrapper) and not isinstance(model, wrapper_cls):
            # vLLM wraps the model for full graphs with its CUDA wrapper directly (not the platform's class).
            wrapper = wrapper_cls(model.unwrap(), self.vllm_config, runtime_mode=CUDAGraphMode.FULL)
            self.model = cast(nn.Module, wrapper)
        self._compile_draft()

    def _compile_draft(self) -> None:
        """The torchair mode: the EAGLE / MTP draft's decode passes compiled per capture size
        (:class:`.graphs.torchair.DraftTorchairWrapper`); EAGLE-3 stays eager (vLLM's proposer checks its model's
        class, which a wrapper would hide)."""
        drafter = getattr(self, "drafter", None)
        spec = self.vllm_config.speculative_config
        if not torchair_enabled(self.vllm_config) or spec is None or not isinstance(drafter, EagleProposer):
            return
        if spec.method == "eagle3" or not self.compilation_config.cudagraph_capture_sizes:
            return
        drafter.model = cast(nn.Module, DraftTorchairWrapper(drafter.model, self.vllm_config))
        drafter.use_cuda_graph = True  # pad each pass to a capture size from the proposer's persistent buffers
        drafter.cudagraph_batch_sizes = sorted(self.compilation_config.cudagraph_capture_sizes)
        if self.parallel_config.data_parallel_size > 1 and spec.num_speculative_tokens > 1:
            # a rank without requests meets each of the k draft passes of the ranks with requests (graphs.dp_pad)
            drafter.dummy_run = dummy_runs_every_pass(drafter.dummy_run, spec.num_speculative_tokens)  # type: ignore[method-assign,assignment]

    def estimate_graph_memory(self) -> int:
        """Device bytes the graph pool will hold once every size is captured, to keep out of the KV budget.

        Graphs are captured largest first into one shared pool and smaller graphs reuse its blocks, so the pool
        holds about one forward's activations at the largest capture size: measured here as the allocator peak of
        an eager dummy forward at that size (before the KV cache exists, so without attention metadata; attention
        outputs are a small part of a forward's activations). 0 when no graphs are captured."""
        mode = self.compilation_config.cudagraph_mode
        sizes = self.compilation_config.cudagraph_capture_sizes or []
        if mode in (None, CUDAGraphMode.NONE) or not sizes:
            return 0
        backend = self.device_backend
        backend.synchronize(self.device)
        backend.reset_peak_memory_stats(self.device)
        base = backend.memory_allocated(self.device)
        self._dummy_run(max(sizes), cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True)
        backend.synchronize(self.device)
        return max(0, backend.peak_memory_allocated(self.device) - base)

    def initialize_cudagraph_capture(self) -> None:
        """vLLM 0.11.0 resolves the graph mode against the attention backends' graph support here, before capture;
        0.11.1 does it when it builds the backends (:meth:`_check_and_update_cudagraph_mode`), so nothing is left."""
        if torchair_enabled(self.vllm_config):
            self._torchair_graph_keys()
        elif not MODE_RESOLVED_AT_BACKEND_INIT:
            super().initialize_cudagraph_capture()
            self._builders_follow_resolved_mode()

    def _check_and_update_cudagraph_mode(self, attention_backends: Any, kv_cache_groups: Any) -> None:
        """vLLM 0.11.1's resolution of the graph mode (0.11.0: in :meth:`initialize_cudagraph_capture`)."""
        if torchair_enabled(self.vllm_config):
            self._torchair_graph_keys()
            return
        cast(Any, super())._check_and_update_cudagraph_mode(attention_backends, kv_cache_groups)
        self._builders_follow_resolved_mode()

    def _builders_follow_resolved_mode(self) -> None:
        """vLLM's state-layer builders (GDN, Mamba) read "full graphs on" when they are built, before the mode is
        resolved against the attention backends. A mode downgraded to one without full graphs (Qwen3-Next with MTP
        under FULL_DECODE_ONLY: our attention captures single-token decode only, so vLLM falls back to NONE) would
        leave them padding the metadata of steps the runner no longer pads (the GDN layer then splits too few
        tokens: a shape error in its first decode step)."""
        mode = self.compilation_config.cudagraph_mode
        if mode is None or mode.has_full_cudagraphs():
            return
        for group in self._attn_group_iterator():
            for builder in group.metadata_builders:
                if getattr(builder, "use_full_cuda_graph", False):
                    setattr(builder, "use_full_cuda_graph", False)  # noqa: B010 (not on the base class)

    def _torchair_graph_keys(self) -> None:
        # torchair compiles the decode forward instead of capturing it: attention stays an op called with each step's
        # metadata, so the backends' graph support (SFA's is NEVER) must not downgrade the mode to NONE.
        mode = self.compilation_config.cudagraph_mode
        if mode is None:  # VllmConfig resolves it before any runner exists
            raise RuntimeError("compilation_config.cudagraph_mode was not resolved")
        self.cudagraph_dispatcher.initialize_cudagraph_keys(mode, self.uniform_decode_query_len)

    def _capture_sizes(self, sizes: list[int], runtime_mode: CUDAGraphMode, uniform_decode: bool) -> None:
        """vLLM's capture loop over ``sizes`` (each warmed up eagerly ``cudagraph_num_of_warmups`` times, runtime mode
        NONE, then captured); a capture that runs out of device streams (ACL error 0x7020023) is re-raised with the
        stream budget and the knobs that fix it."""
        try:
            # vLLM 0.11.1 captures (num_tokens, activate_lora) cases; LoRA runs eagerly here, so never with LoRA.
            cases: list[Any] = [(size, False) for size in sizes] if CAPTURE_CASES_WITH_LORA else list(sizes)
            self._capture_cudagraphs(cases, cudagraph_runtime_mode=runtime_mode, uniform_decode=uniform_decode)
        except Exception as error:
            if not is_stream_exhaustion(error):
                raise
            mode = "PIECEWISE" if runtime_mode == CUDAGraphMode.PIECEWISE else "FULL_DECODE_ONLY"
            budget = stream_budget(self.vllm_config, mode)
            raise GraphStreamsExhaustedError(stream_exhaustion_message(mode, sizes, budget)) from error

    def capture_model(self) -> int:
        """Capture every configured graph; returns the device memory the graphs took (bytes, as vLLM's)."""
        mode = self.compilation_config.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            return 0
        self.initialize_cudagraph_capture()  # may downgrade the mode from the attention backends' support
        mode = self.compilation_config.cudagraph_mode
        assert mode is not None, "VllmConfig.__post_init__ always sets cudagraph_mode"
        compilation_counter.num_gpu_runner_capture_triggers += 1
        backend = self.device_backend
        backend.synchronize(self.device)
        gc.collect()
        free_before = backend.mem_get_info(self.device)[0]
        start = time.perf_counter()
        set_cudagraph_capturing_enabled(True)
        gc.freeze()  # objects alive now are not collected during capture (vLLM's freeze_gc)
        try:
            with cuda_stream_api_as(backend):
                if mode.mixed_mode() != CUDAGraphMode.NONE:
                    sizes = sorted(self.cudagraph_batch_sizes, reverse=True)
                    self._capture_sizes(sizes, mode.mixed_mode(), uniform_decode=False)
                if mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine():
                    q = self.uniform_decode_query_len
                    limit = self.scheduler_config.max_num_seqs * q
                    sizes = sorted((s for s in self.cudagraph_batch_sizes if q <= s <= limit), reverse=True)
                    self._capture_sizes(sizes, CUDAGraphMode.FULL, uniform_decode=True)
        finally:
            set_cudagraph_capturing_enabled(False)
            gc.unfreeze()
            gc.collect()
        backend.synchronize(self.device)
        taken = max(0, free_before - backend.mem_get_info(self.device)[0])
        logger.info(
            "captured %d static graphs (%s) in %.2f s, %.3f GiB",
            compilation_counter.num_cudagraph_captured - self.cudagraph_captured_before,
            mode.name,
            time.perf_counter() - start,
            taken / (1 << 30),
        )
        return taken

    # --- sleep mode: graphs over moved weights and KV caches --------------------------------------------------

    def release_graphs(self) -> int:
        """Drop every captured graph (ACL or twin) and every torchair compiled size of this engine; returns how
        many. Sleep mode calls it: wake-up gives the weights and KV caches new device addresses, which graphs
        captured before would not see (see :mod:`.worker`)."""
        released = sum(cast(Any, w).reset_graphs() for w in engine_wrappers(self.vllm_config))
        if released:
            logger.info("released %d static graphs / compiled sizes", released)
        return released

    def recapture_graphs(self) -> int:
        """Capture (torchair: compile) every graph again, after :meth:`release_graphs` and wake-up: vLLM's capture
        loop as at start-up (:meth:`capture_model`). Returns the device memory the graphs took (bytes)."""
        return self.capture_model()

    # --- KV cache -----------------------------------------------------------------------------------------------

    def _num_attn_module(self) -> int:
        # vLLM's rule (GPUModelRunner.initialize_kv_cache_tensors): LongCat-Flash has two attention modules per layer.
        return 2 if self.model_config.hf_config.model_type == "longcat_flash" else 1

    def _cache_layers_share_an_index(self, kv_cache_config: KVCacheConfig) -> bool:
        names = {name for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
        names.update(self.shared_kv_cache_layers)
        n = self._num_attn_module()
        return len({extract_layer_index(name, n) for name in names}) < len(names)

    def _update_hybrid_attention_mamba_layout(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hybrid models (attention + Mamba-style state layers): give each attention layer its own contiguous
        ``(2, num_blocks, block_size, heads, head_dim)`` cache instead of vLLM's re-strided view of the page it
        shares with the state layers.

        vLLM re-strides that view to ``(num_blocks, 2, ...)`` so that block ``i`` of K and V lies in page ``i`` of
        the shared buffer; the key and value caches are then non-contiguous with a block stride of two blocks, which
        the NPU cache kernels (``_npu_reshape_and_cache``, paged attention over block tables) do not take.
        vllm-ascend v0.11.0 (``NPUModelRunner._allocate_kv_cache_tensors``, "for other attentions") allocates
        separate K and V buffers for the attention layers of a hybrid model the same way. Cost: the attention
        layers' pages are allocated on top of the pool vLLM sized (docs/hybrid.md, "Memory")."""
        for group in self._kv_cache_spec_attn_group_iterator():
            if not hasattr(group.kv_cache_spec, "num_kv_heads"):  # a state (Mamba) group
                continue
            for name in group.layer_names:
                shared = kv_caches[name]
                kv_caches[name] = torch.zeros(shared.shape, dtype=shared.dtype, device=shared.device)

    def initialize_kv_cache_tensors(
        self, kv_cache_config: KVCacheConfig, *kernel_block_sizes: list[int]
    ) -> dict[str, torch.Tensor]:
        """Allocate, shape and bind the KV caches; returns layer name -> cache tensor (vLLM's contract).

        ``kernel_block_sizes`` (one block size per KV-cache group) is the argument vLLM 0.11.1 added to this method
        and to ``_reshape_kv_cache_tensors``: passed through when vLLM gives it, absent on 0.11.0."""
        if not self._cache_layers_share_an_index(kv_cache_config):
            return super().initialize_kv_cache_tensors(kv_cache_config, *kernel_block_sizes)
        raw = self._allocate_kv_cache_tensors(kv_cache_config)
        kv_caches = self._reshape_kv_cache_tensors(kv_cache_config, raw, *kernel_block_sizes)
        for layer_name, target_layer_name in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target_layer_name]
        n = self._num_attn_module()
        first_per_index: dict[int, str] = {}
        for layer_name in kv_caches:
            first_per_index.setdefault(extract_layer_index(layer_name, n), layer_name)
        forward_context = self.compilation_config.static_forward_context
        bind_kv_cache({name: kv_caches[name] for name in first_per_index.values()}, forward_context, self.kv_caches, n)
        for layer_name, kv_cache in kv_caches.items():
            forward_context[layer_name].kv_cache = [kv_cache]  # a list: vLLM's (V0 virtual-engine) convention
        return kv_caches
