# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The built-in patch set for the vLLM 0.11 line (written on 0.11.0; ``changes`` record the code of 0.11.1 and
0.11.2, reviewed): pure declarations (strings only), so importing this module is cheap.

Each patch states the behaviour that fails (or costs) without it, its upstream reference and its removal plan.
Implementations live beside this file and are imported only when a patch is applied. The rendered table is
docs/patches.md (``vllm-npu patches --markdown``).

Candidates looked at and left out are listed in ``NOT_PATCHED`` with the reason.
"""

from __future__ import annotations

from vllm_npu.interface import Scope

from .._model import NOT_CHECKED, Patch

REPETITION_PENALTY_TORCH = Patch(
    id="repetition-penalty-torch",
    target="vllm._custom_ops.apply_repetition_penalties",
    replacement="vllm_npu.patches.sets.repetition_penalty:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.12",
    fingerprint="8e6d3df2802ab01c9116a95dcdc18af975ce82468fbb76101cbeb48a9a2d787a",
    also_checks=(
        # looks the target up at call time: the rebinding reaches the sampler only while this stays so
        (
            "vllm.model_executor.layers.utils.apply_penalties",
            "f2be2317125fea56f62425aee25e2769f5ab9efb399514fa471e9cba8be0dbc7",
        ),
        # the implementation the replacement delegates to
        (
            "vllm._custom_ops.apply_repetition_penalties_torch",
            "24ae415a9d04fe3761253e4907f932840e4c8abd630daed8f24d633d398058d8",
        ),
    ),
    upstream="none filed yet; the branch came with vllm#18437 (https://github.com/vllm-project/vllm/pull/18437). "
    "Fix to propose: dispatch on current_platform.is_cuda() / logits.device.type instead of Tensor.is_cuda",
    reason="vLLM picks its CUDA-only _C kernel when `logits.is_cuda`; torch_npu aliases Tensor.is_cuda to is_npu "
    "when transfer_to_npu is imported or TORCH_NPU_SANITIZER is set, and the NPU build of vLLM has no _C, so the "
    "first request with repetition_penalty != 1 fails with AttributeError (_C has no apply_repetition_penalties_)",
    removal="drop when vLLM dispatches this kernel on the platform or the tensor's device type rather than "
    "Tensor.is_cuda (or when the plugin's vLLM floor has that fix)",
)

ATTENTION_OUTPUT_EMPTY = Patch(
    id="attention-output-empty",
    target="vllm.attention.layer.Attention.forward",
    replacement="vllm_npu.patches.sets.attention_output:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="c313406a30b0956a1619c26568c966dc8fe71bdd43e476439d62fe8ec39d2210",
    also_checks=(
        # the custom op the patched forward calls by name with the same arguments
        (
            "vllm.attention.layer.unified_attention_with_output",
            "8964f6d3b3101bb78fc898098d6b6b13d6c8fa5e2834ebfa9c9d826cdb7b280e",
        ),
    ),
    upstream="https://github.com/vllm-project/vllm/pull/26680",
    reason="Attention.forward zero-fills its output buffer (torch.zeros) in every layer on every step: one extra "
    "kernel per layer per decode step on the NPU that graph capture cannot remove. Uses torch.empty only for "
    "attention impls declaring fills_output_buffer=True (they write every element, profile run included); "
    "every other layer keeps vLLM's forward",
    removal="drop when the plugin's vLLM floor includes vllm#26680 (after 0.11.0); the range already ends at 0.11.1",
)

EAGLE_DISCARDED_NEXT_TOKEN = Patch(
    id="eagle-discarded-next-token",
    target="vllm.v1.spec_decode.eagle.EagleProposer.prepare_next_token_ids_padded",
    replacement="vllm_npu.patches.sets.eagle_next_token:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="ff3bd95dc650e495c599b7959b5c3324150ef6b9ba53f069b9fb461449c91528",
    upstream="https://github.com/vllm-project/vllm/pull/26231 (test: https://github.com/vllm-project/vllm/pull/26263)",
    reason="with EAGLE / EAGLE-3 / MTP speculative decoding and chunked prefill, a step that has a partially "
    "prefilled request and no request with draft tokens (e.g. the first step of a batch of long prompts) hands the "
    "drafter token id -1 for the partial request (vLLM skips its validity mask when sampled_token_ids has one "
    "column), and the drafter's embedding fails (IndexError: index out of range) and the engine dies; the "
    "replacement gives such rows their backup token, as vLLM does after the fix",
    removal="drop when the plugin's vLLM floor includes vllm#26231 (after 0.11.0); the range already ends at 0.11.1",
)

HYBRID_PREFILL_NO_DRAFTS = Patch(
    id="hybrid-prefill-no-drafts",
    target="vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids",
    replacement="vllm_npu.patches.sets.hybrid_prefill_drafts:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.12",
    fingerprint="a4f9ff05003230e3d7e6707da9c5cd65e8945f0e5c6a9e1507a322fa21637b11",
    # 0.11.1 dropped the branch that cleared a request's drafts when the proposer gave none; the method still
    # stores every listed request's drafts, prompt chunks included (the same in 0.11.2). Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids",
                    "0dcf58e7247de7a4a7c4ba2213895dd1d0aed55f595c4e6194cfd19822b37b6f",
                ),
            ),
        ),
    ),
    upstream="https://github.com/vllm-project/vllm/pull/30618",
    reason="with EAGLE/MTP speculative decoding and chunked prefill, the drafts proposed for a partly prefilled "
    "request are scheduled with its last prompt chunk, which the runner runs as prefill: a recurrent-state layer "
    "(Qwen3-Next's gated delta-net) then stores a state that includes the draft tokens, and the request decodes "
    "wrong tokens from its first step when a draft is rejected (found with Qwen3-Next + MTP, a 64-token budget and "
    "a 150-token prompt). The replacement clears the drafts of requests still in their prompt",
    removal="drop when the plugin's vLLM floor schedules prompt chunks without drafts (vllm#30618 or its successor)",
)

EPLB_PLATFORM_CHECK = Patch(
    id="eplb-platform-check",
    target="vllm.config.parallel.ParallelConfig.__post_init__",
    replacement="vllm_npu.patches.sets.eplb_platform_check:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.12",
    fingerprint="18326577a4f466c945ef4e46f387ea26cde4a399cdb15b021b444e2dcc1b4f84",
    # 0.11.1 refuses EPLB off CUDA-alike platforms (is_cuda_alike) in the same block; the other EPLB checks moved
    # (num_redundant_experts < 0 is EPLBConfig's now: check_eplb repeating it is harmless). Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.config.parallel.ParallelConfig.__post_init__",
                    "40ef150a32ad94b81638e807e01d622dbc125b992fdcd07934480fc6ffc4222d",
                ),
            ),
        ),
    ),
    upstream="none filed yet. Fix to propose: ask the platform (a Platform.supports_eplb() hook, False by default, "
    "True for CUDA) instead of current_platform.is_cuda() in ParallelConfig.__post_init__",
    reason="vLLM refuses --enable-eplb on every platform but CUDA at config time, although EplbState and its "
    "weight exchange run on torch.distributed groups (gloo / HCCL). The replacement runs vLLM's __post_init__ "
    "with EPLB off for the call and then vLLM's other EPLB checks (redundant >= 0, expert parallel, TP*DP > 1) "
    "itself; npu-ops' MoE layers follow vLLM's EplbState and npu-platform's model runner maps its "
    "torch.cuda.synchronize to the device backend",
    removal="drop when vLLM asks the platform whether it supports EPLB (or when the plugin's vLLM floor has such "
    "a hook); the range ends before 0.12, whose config code must be checked again",
)

SHUTDOWN_ENDS_REQUESTS = Patch(
    id="shutdown-ends-requests",
    target="vllm.v1.engine.async_llm.AsyncLLM.shutdown",
    replacement="vllm_npu.patches.sets.shutdown_abort:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.12",
    fingerprint="39837966ac93f7633c22bb2d06d40092082483275d5ec881c6f7e5575130afd3",
    # 0.11.1: shutdown checks output_handler for None; abort_requests releases the LoRA state through
    # request_finished and still hands each aborted request its ABORT output. Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.v1.engine.async_llm.AsyncLLM.shutdown",
                    "61774f32aa351b575ee4d1212d41f35589d79df1a6721b8ac4c6a9c67dee87a3",
                ),
                (
                    "vllm.v1.engine.output_processor.OutputProcessor.abort_requests",
                    "6c987f619069ab38b0e50e29ef30f3ae6afee3e3ea293567d39ab1aeb50a67e7",
                ),
            ),
        ),
    ),
    also_checks=(
        # the replacement relies on it handing each aborted request a final output with FinishReason.ABORT
        (
            "vllm.v1.engine.output_processor.OutputProcessor.abort_requests",
            "383db4ae41faf3a79cd77366d36962a989a43dfb1898fb8305f9e68a4d4d623e",
        ),
    ),
    upstream="https://github.com/vllm-project/vllm/issues/24885 (shutdown semantics RFC); fixed upstream by "
    "https://github.com/vllm-project/vllm/pull/34730 (re-landed as #36666: on SIGTERM in-flight requests are "
    "aborted, or drained with --shutdown-timeout), after 0.11",
    reason="SIGTERM / SIGINT to `vllm serve` stops the engine (AsyncLLM.shutdown) before uvicorn closes the "
    "connections, and nothing ends the requests in flight: a streaming client gets neither an error nor a finish "
    "and waits until its own timeout, and the server waits for that connection instead of exiting. The replacement "
    "ends every in-flight request with finish_reason 'abort' (vLLM's OutputProcessor.abort_requests) before vLLM's "
    "shutdown runs",
    removal="drop when the plugin's vLLM floor aborts in-flight requests on shutdown itself (vllm#34730/#36666); "
    "the range ends before 0.12, whose shutdown path must be checked again",
)

REQUEST_FAULT_ISOLATION = Patch(
    id="request-fault-isolation",
    target="vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
    replacement="vllm_npu.patches.sets.request_faults:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.12",
    fingerprint="2631ab000e5bc3a6fdc5e6f6f8f991b359f72211c826e652976c32291fa7534a",
    # 0.11.1: update_from_output skips requests whose KV load failed and publishes KV events; finish_requests skips
    # finished requests. The replacement wraps the original, so it still fits. Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
                    "9644fd36a95004a46dca6e2da45635f4c39956c8fd5bfbf05faace832d027b2f",
                ),
                (
                    "vllm.v1.core.sched.scheduler.Scheduler.finish_requests",
                    "49c9ad9caa8d6305c12a914b5c31e3d6bd8e458edaf2e74d6594332a4bbba407",
                ),
            ),
        ),
    ),
    also_checks=(
        # frees, unqueues and reports (finished_req_ids) the failed requests before vLLM's loop skips them
        (
            "vllm.v1.core.sched.scheduler.Scheduler.finish_requests",
            "44216890bce6a62d6d57e20cb1b9a9ea07074eced4a0e18de3e6fd9241335249",
        ),
    ),
    upstream="none filed yet. Fix to propose: a per-request error field in ModelRunnerOutput that the scheduler turns "
    "into a finished request with an error, instead of ending the engine core on any exception in execute_model",
    reason="any exception in one request's logits processing (its structured-output bitmask row, its per-request "
    "logits processor) ends vLLM's engine core: EngineDeadError for every request and `vllm serve` exits. "
    "npu-platform's model runner reports such requests on the step's output (interface.protocols.RequestFaultReport) "
    "and the replacement finishes exactly those with finish_reason abort and the error as stop_reason",
    removal="drop when vLLM can fail one request from the model runner (or when the plugin's vLLM floor has such a "
    "field); the range ends before 0.12, whose scheduler must be checked again",
)

_TOKEN_TYPES_REASON = (
    "{model}'s embedding layer splits the cross-encoder's token types out of input_ids with bit shifts "
    "(_decode_token_type_ids: <<, >>) inside the compiled model, whose first piece pooling models capture as a "
    "PIECEWISE graph by default; torch_npu 2.8.0 has the shifts only as ACL ops (aclops LeftShift/RightShift, no "
    "aclnn kernel) and an ACL graph captures aclnn kernels only, so the capture fails on an NPU (vllm-ascend "
    "v0.11.0 patches RoBERTa for this: patch/worker/patch_roberta.py). The replacement is the same decode with "
    "floor_divide and bitwise_and (aclnn kernels), in place like vLLM's"
)
_TOKEN_TYPES_REMOVAL = (
    "drop when CANN has aclnn shift kernels that ACL graphs capture, or when vLLM decodes token types without "
    "shifts; the range ends before 0.12, whose bert.py / roberta.py must be checked again"
)
_TOKEN_TYPES_UPSTREAM = (
    "none filed yet (vllm-ascend's note: 'this need CANN add an aclnn shift operation'). Fix to propose: "
    "decode with // and & in vllm/model_executor/models/bert.py"
)

BERT_TOKEN_TYPES_NO_SHIFT = Patch(
    id="bert-token-types-no-shift",
    target="vllm.model_executor.models.bert._decode_token_type_ids",
    replacement="vllm_npu.patches.sets.token_types:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.12",
    fingerprint="2ff3653faa0ef36e9eb1d32ff03b3465834506909dbe491431ea56b02d087a5c",
    also_checks=(
        # looks the target up in bert's module globals at call time (traced into the graph's first piece)
        (
            "vllm.model_executor.models.bert.BertEmbedding.forward",
            "57157018fdcadeb9d24b25bbe51e96a7dc14c65a0a5afc7bea16354582c49564",
        ),
    ),
    # 0.11.1: forward takes an optional inputs_embeds and still decodes the types with the target (unchanged) first.
    # Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.model_executor.models.bert.BertEmbedding.forward",
                    "adce4c019c95a23e4e337177362d26b08c1e3817e3ed0b0eb0aaf68a33fd9d95",
                ),
            ),
        ),
    ),
    upstream=_TOKEN_TYPES_UPSTREAM,
    reason=_TOKEN_TYPES_REASON.format(model="BERT"),
    removal=_TOKEN_TYPES_REMOVAL,
)

ROBERTA_TOKEN_TYPES_NO_SHIFT = Patch(
    id="roberta-token-types-no-shift",
    # roberta.py imports the function by name, so its own module attribute is what RobertaEmbedding.forward calls
    target="vllm.model_executor.models.roberta._decode_token_type_ids",
    replacement="vllm_npu.patches.sets.token_types:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.12",
    fingerprint="2ff3653faa0ef36e9eb1d32ff03b3465834506909dbe491431ea56b02d087a5c",
    also_checks=(
        (
            "vllm.model_executor.models.roberta.RobertaEmbedding.forward",
            "57157018fdcadeb9d24b25bbe51e96a7dc14c65a0a5afc7bea16354582c49564",
        ),
    ),
    # 0.11.1: forward takes an optional inputs_embeds and still decodes the types with the target (unchanged) first.
    # Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.model_executor.models.roberta.RobertaEmbedding.forward",
                    "adce4c019c95a23e4e337177362d26b08c1e3817e3ed0b0eb0aaf68a33fd9d95",
                ),
            ),
        ),
    ),
    upstream=_TOKEN_TYPES_UPSTREAM,
    reason=_TOKEN_TYPES_REASON.format(model="RoBERTa (XLM-RoBERTa: bge-m3, bge-reranker-v2-m3)"),
    removal=_TOKEN_TYPES_REMOVAL,
)

UNSUPPORTED_API_STATUS = Patch(
    id="unsupported-api-status",
    target="vllm.entrypoints.openai.api_server.base",
    replacement="vllm_npu.patches.sets.unsupported_api:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.12",
    fingerprint="6b5d1883a2f580314eadcd2993bedcb5855e6853df7b8d9ac5b9cf8f5c8ffda7",
    also_checks=(
        # a route that returns base(...).create_error_response(...) as its response (every such route does)
        (
            "vllm.entrypoints.openai.api_server.create_embedding",
            "cd8b73c3364b8cbe49fc2442042ca021206c4d6399a4c8d7dd57cb80eba2e3aa",
        ),
        # the one caller that reads the result as an ErrorResponse (model_dump, error.code)
        (
            "vllm.entrypoints.openai.api_server.invocations",
            "050c9929f7c82d121e2a562f1eefa9211cc7f8da15b4e361311c0e61f670ca76",
        ),
    ),
    # 0.11.1: the routes still return base(...).create_error_response(...) (create_embedding also streams bytes now);
    # /invocations moved to vllm.entrypoints.sagemaker.routes (it still reads model_dump() and error.code), and the
    # new /v1/messages reads error.code / .type / .message of base's error: the replacement keeps all of them.
    # Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (
                (
                    "vllm.entrypoints.openai.api_server.create_embedding",
                    "6fd5c37649d0dac77160dd40f9db9a27d18f1403268330be7b5f7ac7a58bdc4e",
                ),
                ("vllm.entrypoints.openai.api_server.invocations", NOT_CHECKED),
                (
                    "vllm.entrypoints.sagemaker.routes.register_sagemaker_routes",
                    "0580e0c05b1f7292063047334877303fe5f561e91dfc8c95cff6e70ff378b0bb",
                ),
                (
                    "vllm.entrypoints.openai.api_server.create_messages",
                    "debc67749cd7b68e49aecbc017faf94b5e643a270711b803297ad6b79d29186b",
                ),
            ),
        ),
    ),
    upstream="none filed yet (the symptom: https://github.com/vllm-project/vllm/issues/16831). Fix to propose: "
    "return JSONResponse(content=err.model_dump(), status_code=err.error.code) in the routes, as /invocations does",
    reason="a request to an endpoint the served model does not support (a completion or chat request to an embedding "
    "model or reranker, an embedding or score request to a chat model) answers HTTP 200 with an error body: the "
    "routes return the ErrorResponse model itself, which FastAPI sends with status 200, so clients take the error "
    "for a success. The replacement's error responses carry their status (400) and the same body",
    removal="drop when vLLM's routes answer 'The model does not support ... API' with its status code; the range "
    "ends before 0.12, whose routes (moved to entrypoints/*/api_router.py) must be checked again",
)

MULTIMODAL_MERGE_INDEX_PUT = Patch(
    id="multimodal-merge-index-put",
    target="vllm.model_executor.models.utils._merge_multimodal_embeddings",
    replacement="vllm_npu.patches.sets.multimodal_merge:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="814443abf0c47b5a525a7e7bb38b55afa65a013fbb0235c3d078b8642d146d15",
    also_checks=(
        # every model's merge: looks the target up in utils' globals at call time
        (
            "vllm.model_executor.models.utils.merge_multimodal_embeddings",
            "fdba03f1082eebb9e9d294229c8fd49465eff2933e2089513f0851ba5051c8b3",
        ),
    ),
    upstream="none filed (vllm-ascend carries it as an Ascend-only issue: vllm_ascend/patch/worker/"
    "patch_multimodal_merge.py, PR #3071). Fix to propose: torch_npu/CANN accepting a broadcast mask in "
    "aclnnMaskedScatter, or vLLM merging with index_put_ again (its form before masked_scatter_, per vllm-ascend "
    "PR #3071)",
    reason="vLLM merges the encoder outputs into the prompt embeddings with masked_scatter_ and a [T, 1] mask "
    "broadcast over [T, H]; aclnn's shape check rejects the broadcast mask and torch_npu falls back to the AI CPU for "
    "every multimodal prefill (vllm-ascend measured 2x throughput on Qwen3-VL-Embedding-8B once it merged with "
    "index_put_). The replacement writes inputs_embeds[is_multimodal] = embeddings (index_put_, the call vllm-ascend "
    "v0.11.0 makes on hardware), cast to the embeddings' dtype, same errors as vLLM",
    removal="drop when CANN's masked_scatter takes a broadcast mask on the AI core (or vLLM merges with index_put_); "
    "the range ends at 0.11.1, whose utils.py must be checked again",
)

HOST_OFFLOAD_NPU = Patch(
    id="host-offload-npu",
    target="vllm.v1.kv_offload.cpu.CPUOffloadingSpec.get_handlers",
    replacement="vllm_npu.patches.sets.host_offload:make_replacement",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="3d376d073f3fb4ff6b55cebdf21cfdd4b10664174e9a9f4073c7aaa72ecc36dd",
    also_checks=(
        # the block-pair expansion the replacement reuses
        (
            "vllm.v1.kv_offload.worker.cpu_gpu.expand_block_ids",
            "1dbb9067176ab122158da40aa639a830a1c1b9c94f51bdb19787e456c1a4d5ca",
        ),
    ),
    upstream="none filed yet. Fix to propose: ask the platform for the offloading handler (a Platform hook "
    "returning the device<->host copy handler, vLLM's CUDA one by default) instead of raising off CUDA",
    reason="vLLM's OffloadingConnector (host-memory KV offload, kv_connector_extra_config num_cpu_blocks) fails at "
    "worker start off CUDA ('CPU Offloading is currently only supported on CUDA GPUs'), and its handler copies "
    "with torch.cuda streams and the CUDA kernel ops.swap_blocks along one block dimension, which would mix up "
    "the two planes of our MLA cache. The replacement yields vllm_npu.patches.sets.host_offload.HostOffloadHandler "
    "(pinned host memory, a torch.npu copy stream per direction on the NPU; index copies on the emulated device)",
    removal="drop when vLLM asks the platform for the offloading handler; the range ends before 0.11.1, whose "
    "kv_offload code was not reviewed",
)

HOST_OFFLOAD_STATS = Patch(
    id="host-offload-stats",
    target="vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector",
    replacement="vllm_npu.patches.sets.host_offload_stats:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="d27d2f6d97850b6f3e26bb772a6eecdd1a5f535b26fe6691136b812f2a38504c",
    also_checks=(
        # the inherited stats seams the subclass overrides (both return None in 0.11.0)
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1.get_kv_connector_stats",
            "a5e81cf1fc5f564964ca2db1c782cf8177bf0b9d145022a9953ee80a20ae156f",
        ),
        # reads the connector class off its module by name when the connector is built
        (
            "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory.get_connector_class",
            "c9c37f21206713125c7d440e2f2ca33ea7d488dacd3c5177799d7df70f8a3c12",
        ),
    ),
    upstream="none filed yet. Fix to propose: OffloadingConnector reports an OffloadingConnectorStats (blocks and "
    "bytes per direction) from its OffloadingWorker's finished jobs, and builds it from serialized data",
    reason="vLLM 0.11.0's OffloadingConnector reports no connector stats (get_kv_connector_stats and "
    "build_kv_connector_stats are the base class's, returning None), so host offload hits and stores never reach "
    "SchedulerStats, the log line or /metrics (kv-connector-metrics). The replacement is a subclass of vLLM's "
    "(same name and module) whose worker side reports the HostOffloadHandler's finished transfers as "
    "HostOffloadStats (npu_kv_offload_* counters) and whose class rebuilds them in the API server; a patch replaces "
    "one attribute and the two seams run in different processes, hence the class and not two methods",
    removal="drop when vLLM's OffloadingConnector reports its own stats (then map them in kv-connector-metrics); the "
    "range ends before 0.11.1, whose kv_offload code was not reviewed",
)

MULTI_CONNECTOR_STATS = Patch(
    id="multi-connector-stats",
    target="vllm.distributed.kv_transfer.kv_connector.v1.multi_connector.MultiConnector.build_kv_connector_stats",
    replacement="vllm_npu.patches.sets.multi_connector_stats:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="0569afed934a85d9c92947784a88f4182ad8f09ef4dff6818938520046a78aa6",
    also_checks=(
        # what fails on a dict entry
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector.MultiKVConnectorStats.aggregate",
            "d0554668e9a448d3e507a3b385cd94fdb38771d54955aa3482f3dc548fe762e0",
        ),
    ),
    upstream="none filed yet. Fix to propose: MultiKVConnectorStats rebuilds its entries with each connector's "
    "build_kv_connector_stats when it is built from serialized data",
    reason="with vLLM's MultiConnector (e.g. npu-kv's PD connector + KV pool) and stats logging on, the API server "
    "rebuilds only the outer MultiKVConnectorStats from the engine's serialized stats, its entries stay plain "
    "dicts, and the second observation's aggregate raises AttributeError ('dict' object has no attribute "
    "'aggregate'): the output handler dies and every later request answers HTTP 500. The replacement rebuilds each "
    "entry with its connector class's build_kv_connector_stats",
    removal="drop when vLLM rebuilds MultiConnector stats entries itself; the range ends before 0.11.1, whose "
    "multi_connector code was not reviewed",
)

KV_CONNECTOR_METRICS = Patch(
    id="kv-connector-metrics",
    target="vllm.v1.metrics.loggers.PrometheusStatLogger.record",
    replacement="vllm_npu.patches.sets.kv_connector_metrics:make_replacement",
    scope=Scope.PLATFORM,
    vllm=">=0.11.0,<0.11.1",
    fingerprint="a56fc2d9b13bcc0fb352d710ec2c8c583afb56b4ffcdf0a24c8c9aa2d9366304",
    also_checks=(
        # the attributes the replacement reads (vllm_config, _counter_cls) and the label names it copies
        (
            "vllm.v1.metrics.loggers.PrometheusStatLogger.__init__",
            "3f189c9a8f0837c1c44e4484ebc734a5821a7aea3a0d8ed108ec616328f2b6f1",
        ),
    ),
    upstream="vLLM 0.11.1 added the seam (KVConnectorBase.build_prom_metrics, recorded by KVConnectorPrometheus "
    "from PrometheusStatLogger.record)",
    reason="vLLM 0.11.0 passes the KV connectors' stats (npu-kv's pool: hit / stored blocks and bytes, failed "
    "loads, store errors) only to its log line, not to PrometheusStatLogger, and vllm serve cannot add a stat "
    "logger: without the patch none of them is on /metrics. The replacement runs vLLM's record, then adds each "
    "connector's (every MultiConnector entry's) prometheus_counters() to vllm:npu_kv_* counters labelled "
    "model_name and engine",
    removal="drop when the plugin's vLLM floor is 0.11.1 or later: move PoolStats' counters to the pool "
    "connector's build_prom_metrics; the range already ends at 0.11.1",
)

#: The built-in set, in application order.
BUILTIN_PATCHES: tuple[Patch, ...] = (
    REPETITION_PENALTY_TORCH,
    ATTENTION_OUTPUT_EMPTY,
    EAGLE_DISCARDED_NEXT_TOKEN,
    HYBRID_PREFILL_NO_DRAFTS,
    EPLB_PLATFORM_CHECK,
    SHUTDOWN_ENDS_REQUESTS,
    REQUEST_FAULT_ISOLATION,
    BERT_TOKEN_TYPES_NO_SHIFT,
    ROBERTA_TOKEN_TYPES_NO_SHIFT,
    UNSUPPORTED_API_STATUS,
    MULTIMODAL_MERGE_INDEX_PUT,
    HOST_OFFLOAD_NPU,
    HOST_OFFLOAD_STATS,
    MULTI_CONNECTOR_STATS,
    KV_CONNECTOR_METRICS,
)

#: Candidates examined for vLLM 0.11.0 and deliberately not patched: (what, why not).
NOT_PATCHED: tuple[tuple[str, str], ...] = (
    (
        "RoBERTa's in-place position offset (vllm.model_executor.models.roberta.replace_roberta_positions)",
        "not patched: `position_ids += padding_idx + 1` runs eagerly outside the graph on the runner's persistent "
        "positions buffer, and only the graph's padding slots went stale (vllm#37868: they grew every step until "
        "they overflowed the position table). npu-platform's model runner zeroes the padding positions every step, "
        "as vllm-ascend's runner does (model_runner_v1.py:1366-1368), which fixes it for every model that "
        "offsets its positions in place without touching vLLM.",
    ),
    (
        "BERT / RoBERTa token-type encoding (bert._encode_token_type_ids: `token_type_ids << 30`)",
        "not patched: the cross-encoder's forward encodes eagerly, outside the graph, where torch_npu's ACL "
        "LeftShift kernel runs; only the decode inside the captured embedding layer needs aclnn kernels.",
    ),
    (
        "GroupCoordinator.all_to_all (vllm.distributed.parallel_state)",
        "not needed: vLLM 0.11.0 gives every GroupCoordinator a device communicator chosen by the platform, and "
        "npu-platform's NPUCommunicator (a DeviceCommunicatorBase subclass) implements all_to_all (HCCL on the NPU, "
        "gloo on the emulated device). npu-ops' MoE dispatch calls group.device_communicator.all_to_all, so the "
        "method is reached through vLLM's seam and GroupCoordinator itself needs no new method.",
    ),
    (
        "HCCL pg_options in GroupCoordinator.__init__ (vllm#25417)",
        "without it HCCL groups are created with default options and work; it only tunes HCCL (buffer size and "
        "similar are also set by HCCL_* environment variables). No behaviour fails, so no patch.",
    ),
)
