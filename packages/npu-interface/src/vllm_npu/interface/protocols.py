# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Capabilities that one layer wheel declares on its objects and another layer wheel reads.

Two wheels that neither depend on each other nor should (npu-attention and npu-patches; npu-quant's MoE methods and
npu-ops' MoE layer) still have to agree on an attribute. The agreement lives here, once: each capability is a
:class:`typing.Protocol` (the contract, for type checkers and readers) plus one reader function (what the consuming
wheel calls, so the attribute name is spelled only in this module). A declaring class writes the attribute as a
``ClassVar[bool]`` set to ``True``; anything that does not declare it, or declares anything but ``True``, lacks the
capability: the safe default of every reader. (:class:`GraphInputsProvider` is a method, not a flag: its reader calls
it when the object has it.)
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

__all__ = [
    "EplbMovableExperts",
    "GraphInputsProvider",
    "LayerMoEPlanRunner",
    "MoEGraphTraceable",
    "OutputBufferFiller",
    "RequestFaultReport",
    "fills_output_buffer",
    "graph_inputs_of",
    "moves_experts_with_eplb",
    "report_request_faults",
    "request_faults_of",
    "runs_layer_moe_plan",
    "traces_moe_in_graph",
]


class OutputBufferFiller(Protocol):
    """An attention impl (``AttentionImpl`` subclass) whose ``forward(..., output=...)`` writes every element of
    ``output`` on every call: the profile run (``attn_metadata is None``) and padded token rows included.

    Declared by npu-attention's GQA, MLA and SFA impls; read by npu-patches' ``attention-output-empty`` patch, which
    then allocates the buffer with ``torch.empty`` instead of vLLM's ``torch.zeros`` (one kernel launch less per
    layer per step). Declaring it for an impl that leaves an element unwritten is a silent wrong answer: the
    declaring backend's tests poison the buffer to prove the contract.
    """

    fills_output_buffer: ClassVar[bool]


def fills_output_buffer(impl: object) -> bool:
    """Whether ``impl`` (an attention impl instance or class) declares :class:`OutputBufferFiller`."""
    return getattr(impl, "fills_output_buffer", False) is True


class LayerMoEPlanRunner(Protocol):
    """A FusedMoE quant method (``FusedMoEMethodBase`` subclass) whose ``apply`` runs the layer's own MoE plan:
    ``layer.moe_plan``, built by npu-ops' ``AscendFusedMoE``, through npu-ops' ``moe_forward``.

    Declared by npu-ops' unquantised method and npu-quant's MoE methods; read by ``AscendFusedMoE`` when it builds
    the plan. Only for a declaring method may the plan carry the all-to-all token dispatcher (data-parallel
    attention with attention TP 1), because only such a method runs that dispatcher; any other method (vLLM's own)
    gets the all-gather / reduce-scatter path of ``AscendFusedMoE.forward_impl``.
    """

    uses_layer_moe_plan: ClassVar[bool]


def runs_layer_moe_plan(method: object) -> bool:
    """Whether ``method`` (a FusedMoE quant method instance or class) declares :class:`LayerMoEPlanRunner`."""
    return getattr(method, "uses_layer_moe_plan", False) is True


class MoEGraphTraceable(Protocol):
    """A FusedMoE quant method whose ``apply`` can be traced into a compiled decode graph (the torchair mode): every
    op it runs has a GE converter in torch_npu 2.8.0's torchair (its NPU kernels) or is one opaque registered op (its
    reference twins), and nothing is read on the host while Dynamo traces it.

    Declared by npu-ops' unquantised method and npu-quant's MoE methods (W8A8_DYNAMIC, W4A8_DYNAMIC, static W8A8);
    read by npu-ops' ``AscendFusedMoE`` (``moe_graph_refusal``): only a declaring method's layer calls its
    ``forward_impl`` directly in that mode; any other keeps vLLM's opaque ``vllm.moe_forward`` op.
    """

    traces_in_moe_graph: ClassVar[bool]


def traces_moe_in_graph(method: object) -> bool:
    """Whether ``method`` (a FusedMoE quant method instance or class) declares :class:`MoEGraphTraceable`."""
    return getattr(method, "traces_in_moe_graph", False) is True


class EplbMovableExperts(Protocol):
    """A FusedMoE quant method whose experts move correctly under vLLM's dynamic EPLB (``--enable-eplb``).

    vLLM's rearrangement (``rearrange_expert_weights_inplace``) moves, slot by slot, exactly the tensors of
    ``FusedMoE.get_expert_weights()``: every parameter of the layer (but ``e_score_correction_bias`` and the shared
    experts'), each viewed as ``[local_num_experts, -1]``. A declaring method promises that after
    ``process_weights_after_loading`` every tensor its experts read per expert (weights in the layout the kernel
    reads, scales, offsets, biases, and any copy of them converted for the kernel) is such a parameter, contiguous,
    with the local expert slot as its first dimension; that the layer holds no other parameter; and that it keeps
    no derived per-expert tensor anywhere else (a buffer, a cache): those would not move, and the moved slot would
    compute with its previous expert's values.

    Declared by npu-ops' unquantised method and npu-quant's MoE methods; read by npu-ops' ``AscendFusedMoE``, which
    refuses ``--enable-eplb`` for any other method.
    """

    moves_with_eplb: ClassVar[bool]


def moves_experts_with_eplb(method: object) -> bool:
    """Whether ``method`` (a FusedMoE quant method instance or class) declares :class:`EplbMovableExperts`."""
    return getattr(method, "moves_with_eplb", False) is True


@runtime_checkable
class GraphInputsProvider(Protocol):
    """One step's attention metadata (an attention backend's metadata object) that can lay its per-step data out as
    the inputs of a *compiled* decode graph of a padded batch: fixed-shape device tensors (and the host lists the NPU
    kernels take), so that nothing per step is read from the host, baked in or guarded on inside the graph.

    Declared by npu-attention's GQA metadata; called by npu-platform's torchair wrapper right before each compiled
    decode step with the step's padded batch size (the graph's); the result reaches the impl through
    :data:`vllm_npu.interface.graphs.COMPILED_STEP`. Metadata that does not declare it is left alone; its layers then
    run attention outside the graph (vLLM's opaque attention op).
    """

    def graph_inputs(self, batch_size: int) -> object | None:
        """This step's inputs of a decode graph of ``batch_size`` rows (one query token each: a request's, or one of
        a speculative verification step's tokens), or None when this step cannot run in the graph: the wrapper then
        runs the whole step eagerly."""
        ...


def graph_inputs_of(metadata: object, batch_size: int) -> object | None:
    """``metadata``'s :meth:`GraphInputsProvider.graph_inputs`, or None when it declares none (or declines the
    step: tell the two apart with ``isinstance(metadata, GraphInputsProvider)``)."""
    if not isinstance(metadata, GraphInputsProvider):
        return None
    return metadata.graph_inputs(batch_size)


class RequestFaultReport(Protocol):
    """A model runner's step output (vLLM's ``ModelRunnerOutput``) that names the requests whose own logits
    processing failed in this step: ``{request id: error message}``. Their sampled tokens are not to be used.

    Written by npu-platform's model runner (a grammar bitmask row or a per-request logits processor that raised);
    read by npu-patches' ``request-fault-isolation`` patch of vLLM's scheduler, which finishes exactly those
    requests with finish reason ``abort`` and the message as ``stop_reason``, so the engine keeps serving the others.
    An output without the attribute reports no fault.
    """

    npu_request_faults: dict[str, str]


def report_request_faults(output: object, faults: dict[str, str]) -> None:
    """Attach ``faults`` (``{request id: error}``) to ``output`` (:class:`RequestFaultReport`); nothing when empty."""
    if faults:
        output.npu_request_faults = dict(faults)  # type: ignore[attr-defined]


def request_faults_of(output: object) -> dict[str, str]:
    """The faults ``output`` reports (:class:`RequestFaultReport`), or an empty dict."""
    faults = getattr(output, "npu_request_faults", None)
    return dict(faults) if isinstance(faults, dict) else {}
