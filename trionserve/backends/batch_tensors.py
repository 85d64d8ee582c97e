"""Batch tensors for the framework backends: a batch of requests into framework
inputs, and framework outputs back into per-request responses (what Triton's
backend input collector and output responder do). The schedulers decide what a
batch is; this only moves its tensors.

Inputs of several requests are gathered along the batch dimension with one copy,
into an instance's reusable
:class:`~trionserve.backends.cuda.pipeline.HostBuffers` where it has them (no allocation
per batch; pinned memory on a GPU), else by concatenation; a batch of one request
is passed through untouched unless ``always_copy`` asks for it in the buffers.
Ragged inputs (``allow_ragged_batch``) are concatenated flat, into the
one-dimensional tensor Triton's backends give such models. Outputs are sliced back
to each request as views, without copies; a model's ``batch_output`` tensors are cut
by its source input's shapes instead (:mod:`trionserve.backends.batch_io`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from trionserve.backends.batch_io import BatchTensors, split_batch_outputs
from trionserve.backends.cuda.pipeline import HostBuffers
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor


def gather_inputs(
    requests: Sequence[InferenceRequest],
    reshape: Mapping[str, tuple[int, ...]] | None = None,
    ragged: Collection[str] = (),
    buffers: HostBuffers | None = None,
    always_copy: bool = False,
) -> dict[str, np.ndarray]:
    """Framework inputs for a batch.

    ``reshape`` maps an input to its per-item shape; inputs named in ``ragged`` are
    flattened and concatenated into one dimension (their shapes may differ between
    requests). With ``buffers``, batched inputs are gathered into them (BYTES
    tensors, of Python objects, are still concatenated); ``always_copy`` gathers a
    batch of one request there too (a GPU instance's pinned staging).
    """
    first = requests[0]
    batched = first.batch_size > 0
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in first.inputs.items():
        if name in ragged:
            parts = [r.inputs[name].data.reshape(-1) for r in requests]
            arrays[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            continue
        data = tensor.data
        staged = buffers is not None and data.dtype != object and data.ndim > 0 and batched
        if len(requests) == 1 and not (staged and always_copy):
            array = data
        elif staged:
            assert buffers is not None
            array = buffers.gather(name, [r.inputs[name].data for r in requests])
        else:
            array = np.concatenate([r.inputs[name].data for r in requests], axis=0)
        if reshape and name in reshape:
            target = reshape[name]
            array = array.reshape(((array.shape[0],) + target) if batched else target)
        arrays[name] = array
    return arrays


def split_outputs(
    outputs: Mapping[str, np.ndarray],
    requests: Sequence[InferenceRequest],
    batch_tensors: BatchTensors | None = None,
) -> list[dict[str, np.ndarray]]:
    """Slice batched outputs back to each request (views, no copies); batch outputs
    of ``batch_tensors`` are scattered by their source input's shapes."""
    scattered = split_batch_outputs(batch_tensors, outputs, requests)
    if len(requests) == 1:
        return [{**outputs, **{name: parts[0] for name, parts in scattered.items()}}]
    per_request: list[dict[str, np.ndarray]] = []
    start = 0
    for index, request in enumerate(requests):
        stop = start + request.batch_size
        per_request.append(
            {
                name: scattered[name][index] if name in scattered else array[start:stop]
                for name, array in outputs.items()
            }
        )
        start = stop
    return per_request


def wanted_outputs(requests: Sequence[InferenceRequest], model_outputs: Sequence[str]) -> list[str]:
    """The outputs any request of the batch asked for, in the model's order."""
    wanted: set[str] = set()
    for request in requests:
        if request.requested_outputs is None:
            return list(model_outputs)
        wanted.update(o.name for o in request.requested_outputs)
    return [name for name in model_outputs if name in wanted]


def build_response(
    request: InferenceRequest,
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
    output_datatypes: Mapping[str, str],
    output_reshape: Mapping[str, tuple[int, ...]] | None = None,
) -> InferenceResponse:
    """A response holding the outputs this request asked for, in the order it asked."""
    if request.requested_outputs is None:
        names = [name for name in output_datatypes if name in outputs]
    else:
        names = [o.name for o in request.requested_outputs]
    tensors = []
    for name in names:
        array = outputs[name]
        if output_reshape and name in output_reshape:
            target = output_reshape[name]
            array = array.reshape(
                ((array.shape[0],) + target) if request.batch_size > 0 else target
            )
        tensors.append(Tensor(name, output_datatypes[name], array))
    return InferenceResponse(model_name, model_version, request.id, tensors)


def build_responses(
    requests: Sequence[InferenceRequest],
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
    output_datatypes: Mapping[str, str],
    output_reshape: Mapping[str, tuple[int, ...]] | None = None,
    batch_tensors: BatchTensors | None = None,
) -> list[InferenceResponse]:
    """One response per request from a batch's outputs, sliced back to each request
    (batch outputs scattered: :func:`split_outputs`)."""
    if len(requests) == 1 and (batch_tensors is None or not batch_tensors.outputs):
        # The outputs are the one request's as they are.
        return [
            build_response(
                requests[0], model_name, model_version, outputs, output_datatypes, output_reshape
            )
        ]
    return [
        build_response(
            request, model_name, model_version, per_request, output_datatypes, output_reshape
        )
        for request, per_request in zip(requests, split_outputs(outputs, requests, batch_tensors))
    ]
