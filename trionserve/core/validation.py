"""Checking a request against a model's inputs and outputs before it is queued.

Errors name the model, the tensor and what was expected, with Triton's wording, so
clients written against Triton see the same messages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelInput, ModelOutput


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # wire name
    dims: tuple[int, ...]  # per-item dims as the client sees them (-1 = any)
    optional: bool = False
    allow_ragged_batch: bool = False


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """The tensors of one model version, as requests must match them."""

    name: str
    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]

    @classmethod
    def from_config(cls, config: ModelConfig) -> ModelSignature:
        def spec(entry: ModelInput | ModelOutput, optional: bool, ragged: bool) -> TensorSpec:
            return TensorSpec(
                name=entry.name,
                datatype=datatypes.BY_CONFIG[_type_name(entry.data_type)].wire,
                dims=tuple(entry.dims),
                optional=optional,
                allow_ragged_batch=ragged,
            )

        # The sequence batcher supplies control and implicit state inputs, never
        # the client, even where auto-complete listed them as inputs.
        batching = config.sequence_batching
        supplied = {c.name for c in batching.control_input}
        supplied.update(s.input_name for s in batching.state)
        return cls(
            name=config.name,
            max_batch_size=config.max_batch_size,
            inputs={
                i.name: spec(i, i.optional, i.allow_ragged_batch)
                for i in config.input
                if i.name not in supplied
            },
            outputs={o.name: spec(o, False, False) for o in config.output},
        )

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """The shape shown in metadata: with a -1 batch dimension when batching."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.dims)


def _type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names(names: Iterable[str]) -> str:
    """Names as Triton lists them: ``['a','b']``."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


# The last signature each decoded shape (``InferenceRequest.shape_key``) passed
# against, and the batch size it gave (bounded: emptied when full).
_PASSED: dict[object, tuple[ModelSignature, int]] = {}
_PASSED_SIZE = 64


def validate_request(request: InferenceRequest, signature: ModelSignature) -> None:
    """Check inputs and requested outputs; set ``request.batch_size``.

    Raises InvalidArgument naming the first problem found. A request whose
    ``shape_key`` passed against this signature before (its inputs' names,
    types and shapes and its requested outputs are those of the request that
    passed) is not checked again.
    """
    key = request.shape_key
    if key is not None:
        passed = _PASSED.get(key)
        if passed is not None and passed[0] is signature:
            request.batch_size = passed[1]
            return
    _validate(request, signature)
    if key is not None:
        if len(_PASSED) >= _PASSED_SIZE:
            _PASSED.clear()
        _PASSED[key] = (signature, request.batch_size)


def _validate(request: InferenceRequest, signature: ModelSignature) -> None:
    model = signature.name
    inputs = request.inputs
    specs = signature.inputs
    if not specs.keys() >= inputs.keys():
        for name in inputs:
            if name not in specs:
                raise InvalidArgument(f"unexpected inference input '{name}' for model '{model}'")
    # Every input given is the model's (above): with as many, none is missing.
    if len(inputs) != len(specs) and (
        missing := [n for n, s in specs.items() if not s.optional and n not in inputs]
    ):
        # Triton's words (core infer_request.cc ValidateRequestInputs): a range when
        # the model has optional inputs.
        required = sum(1 for s in signature.inputs.values() if not s.optional)
        total = len(signature.inputs)
        expected = (
            f"{total} inputs"
            if total == required
            else f"number of inputs between {required} and {total}"
        )
        raise InvalidArgument(
            f"expected {expected} but got {len(inputs)} inputs for model "
            f"'{model}'. Got input(s) {_names(inputs)}, but missing required input(s) "
            f"{_names(missing)}. Please provide all required input(s)."
        )

    batched = signature.max_batch_size > 0
    batch_size = 0
    for name, tensor in inputs.items():
        spec = specs[name]
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{name}' data-type is '{tensor.datatype}', but "
                f"model '{model}' expects '{spec.datatype}'"
            )
        shape = tensor.data.shape
        item_shape = shape
        if batched:
            if len(shape) == 0:
                raise InvalidArgument(
                    f"input '{name}' for model '{model}' has no batch dimension; "
                    f"expected shape {_fmt(signature.full_shape(spec))}"
                )
            this_batch = shape[0]
            if batch_size == 0:
                batch_size = this_batch
            elif this_batch != batch_size:
                raise InvalidArgument(
                    f"input '{name}' batch size {this_batch} does not match other "
                    f"inputs' batch size {batch_size} for model '{model}'"
                )
            item_shape = shape[1:]
        # A ragged input is checked like any other: allow_ragged_batch only lets
        # requests of different shapes share a batch (core infer_request.cc
        # ValidateRequestInputs checks batch size and dims whatever it says).
        if not _matches(item_shape, spec.dims):
            raise InvalidArgument(
                f"unexpected shape for input '{name}' for model '{model}'. Expected "
                f"{_fmt(signature.full_shape(spec))}, got {_fmt(shape)}"
            )

    if batched:
        if batch_size < 1:
            raise InvalidArgument(
                f"inference request batch-size must be >= 1 for '{model}', got {batch_size}"
            )
        if batch_size > signature.max_batch_size:
            raise InvalidArgument(
                f"inference request batch-size must be <= {signature.max_batch_size} "
                f"for '{model}', got {batch_size}"
            )
    request.batch_size = batch_size

    if request.requested_outputs is not None:
        seen: set[str] = set()
        for output in request.requested_outputs:
            if output.name not in signature.outputs:
                raise InvalidArgument(
                    f"unexpected inference output '{output.name}' for model '{model}'"
                )
            if output.name in seen:
                raise InvalidArgument(
                    f"output '{output.name}' requested more than once for model '{model}'"
                )
            seen.add(output.name)


def _matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    if shape == dims:
        return True
    if len(shape) != len(dims):
        return False
    return all(d == -1 or d == s for s, d in zip(shape, dims))


_INT64_MAX = 2**63 - 1


def check_shape_size(name: str, shape: list[int], itemsize: int = 0) -> None:
    """Refuse an input shape no buffer can hold, in Triton's words where Triton
    refuses it (server src/http_server.cc ParseJsonTritonIO: an element count past
    INT64_MAX, then element count times ``itemsize`` past it; BYTES, itemsize 0,
    is sized by its data), and in ours for one numpy cannot hold: non-zero
    dimensions that would take more bytes than it can index (at most 8 bytes an
    element), which numpy refuses even when another dimension is 0."""
    shown = "[" + ",".join(map(str, shape)) + "]"
    count = math.prod(shape)
    if count > _INT64_MAX:
        raise InvalidArgument(
            f"invalid shape for input '{name}': shape {shown} causes total element count "
            f"to exceed maximum size of {_INT64_MAX}"
        )
    if itemsize > 1 and count * itemsize > _INT64_MAX:
        raise InvalidArgument(
            f"byte size overflow for input '{name}': element count ({count}) * data type "
            f"size ({itemsize}) exceeds maximum allowed size ({_INT64_MAX})"
        )
    size = 8
    for d in shape:
        size *= d or 1
    if size > _INT64_MAX:
        raise InvalidArgument(f"invalid shape for input '{name}': {shown} is too large")


def byte_size_mismatch(
    name: str, model: str, expected: int, got: int, shape: Iterable[int], wire: str
) -> str:
    """Core's words for an input whose bytes do not match its shape (core
    src/infer_request.cc ValidateRequestInputs 1241-1248: "input byte size mismatch
    for input 'X' for model 'M'. Expected E, got G"; qa/L0_shared_memory
    test_too_big_shm), and the shape and datatype that gave E."""
    return (
        f"input byte size mismatch for input '{name}' for model '{model}'. "
        f"Expected {expected}, got {got} (shape {_fmt(shape)} of {wire})"
    )


def parse_model_version(text: str) -> int | None:
    """The model version of a URL path segment or a request field: "" -> None (the
    model's policy decides), a positive integer -> int. Errors in Triton's words
    (server ``src/common.cc``, ``GetModelVersionFromString``); unlike Triton's
    ``std::stol``, trailing characters (``"2x"``) are refused, not dropped."""
    if text == "":
        return None
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 19) or (
        int(text) > _INT64_MAX
    ):
        raise InvalidArgument(
            f"failed to get model version from specified version string '{text}' "
            "(details: stol), version should be an integral value > 0"
        )
    version = int(text)
    if version <= 0:
        raise InvalidArgument(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    return version
