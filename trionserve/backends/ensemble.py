"""The ensemble platform at load time: an ensemble's steps checked against its models.

An ensemble (``platform: "ensemble"``) has no model file and no instances; loading
it means checking its ``ensemble_scheduling`` steps against the composing models
that serve now and turning them into an :class:`EnsemblePlan`, which the
:class:`~trionserve.schedulers.ensemble.EnsembleScheduler` runs. The configuration's
own structure (each tensor written once, no cycles, inputs and outputs mapped) is
checked earlier by ``validate_model_config``; here come the checks that need the
composing models: each exists and is READY, each mapped name is one of its
tensors, its required inputs are all mapped, and datatypes and shapes agree along
every edge of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

import trio

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.core.errors import InternalError, InvalidArgument, TritonError, Unavailable
from trionserve.core.validation import ModelSignature, TensorSpec

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

ENSEMBLE_INPUTS = -1  # the producer index of the ensemble's own inputs

# Runs of one step in flight for one request when max_inflight_requests is 0
# (unlimited in Triton): bounded here, so a fast decoupled producer waits instead.
DEFAULT_MAX_INFLIGHT = 64


@dataclass(frozen=True, slots=True)
class Step:
    """One step: which model it calls and how its tensors map to the ensemble's."""

    index: int
    model_name: str
    model_version: int | None  # None: the latest READY version
    # The namespace the registry bound the step to (``model_namespace``; "" without
    # namespacing): steps route to exactly that model.
    model_namespace: str
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor
    decoupled: bool
    batching: bool  # the model has a batch dimension (max_batch_size > 0)
    input_dims: dict[str, tuple[int, ...]]  # model input -> its dims, batch left out

    def __str__(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    """A checked ensemble: its steps and the edges between them.

    ``producers[i]`` are the steps (or ENSEMBLE_INPUTS) whose tensors step ``i``
    reads; ``consumers[p]`` the steps reading a tensor that ``p`` writes.
    ``streaming`` is true when a step may answer more than once (a decoupled
    composing model), so the ensemble answers once per complete set of outputs.
    """

    name: str
    version: int
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]  # the ensemble's inputs, in config order
    outputs: tuple[str, ...]  # the ensemble's outputs, in config order
    output_dims: dict[str, tuple[int, ...]]
    batching: bool  # the ensemble has a batch dimension
    optional_inputs: frozenset[str]
    producers: tuple[frozenset[int], ...]
    consumers: dict[int, tuple[int, ...]]
    streaming: bool
    max_inflight_requests: int  # 0: no limit shared by the ensemble's requests
    # The ensemble's inputs with a ``reshape``: their shape between the steps.
    input_reshape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # The ensemble's outputs with a ``reshape``: the dims a response shows.
    output_client_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _reshaped(spec: TensorSpec, reshape: Mapping[str, tuple[int, ...]]) -> TensorSpec:
    if spec.name not in reshape:
        return spec
    return TensorSpec(
        spec.name, spec.datatype, reshape[spec.name], spec.optional, spec.allow_ragged_batch
    )


class ComposingModel(Protocol):
    """A READY composing model version, as the ensemble reads it (actors'
    ``ModelVersion``)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def signature(self) -> ModelSignature: ...


# (name, version or None for the latest READY, namespace) -> the model, or raises.
Lookup = Callable[[str, int | None, str], ComposingModel]


def plan_ensemble(config: ModelConfig, version: int, lookup: Lookup) -> EnsemblePlan:
    """Check an ensemble against its composing models; raise naming step and tensor.

    ``lookup(name, version, namespace)`` returns the READY model version (with
    ``config`` and ``signature``) or raises the routing error. Call on the Trio
    thread.
    """
    name = config.name
    declared = ModelSignature.from_config(config)
    # The ensemble's own tensors flow between its steps in their ``reshape``
    # shape when they have one (core ensemble_utils.cc ValidateEnsembleConfig:
    # ``input.has_reshape() ? input.reshape().shape() : input.dims()``, the same
    # for outputs); a request's input is reshaped to it and an output back to its
    # dims (EnsembleContext, core ensemble_scheduler.cc).
    input_reshape = {i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")}
    output_reshape = {
        o.name: tuple(o.reshape.shape) for o in config.output if o.HasField("reshape")
    }
    own = ModelSignature(
        declared.name,
        declared.max_batch_size,
        {n: _reshaped(spec, input_reshape) for n, spec in declared.inputs.items()},
        {n: _reshaped(spec, output_reshape) for n, spec in declared.outputs.items()},
    )
    # ensemble tensor -> (wire datatype, dims, full shape, who writes it)
    tensors: dict[str, tuple[str, tuple[int, ...], list[int], str]] = {
        spec.name: (
            spec.datatype,
            spec.dims,
            own.full_shape(spec),
            f"ensemble input '{spec.name}'",
        )
        for spec in own.inputs.values()
    }
    writer: dict[str, int] = {t: ENSEMBLE_INPUTS for t in tensors}
    steps: list[Step] = []
    signatures: list[ModelSignature] = []
    for index, entry in enumerate(config.ensemble_scheduling.step):
        step_version = entry.model_version if entry.model_version > 0 else None
        where = f"ensemble '{name}' step {index} (model '{entry.model_name}')"
        try:
            model = lookup(entry.model_name, step_version, entry.model_namespace)
        except TritonError as exc:
            raise Unavailable(f"{where}: composing model is not available: {exc.message}") from None
        signature: ModelSignature = model.signature
        # Triton's words (core src/ensemble_scheduler/ensemble_utils.cc:296,
        # ValidateTensorMapping :137, :168, :191), in its order.
        step_id = (
            f"{entry.model_namespace}::{entry.model_name}"
            if entry.model_namespace
            else (entry.model_name)
        )
        if config.max_batch_size > signature.max_batch_size > 0:
            raise InvalidArgument(
                f"ensemble {name} allows maximum batch size {config.max_batch_size}, but it "
                f"contains model {entry.model_name} which only allows maximum batch size to "
                f"be {signature.max_batch_size}"
            )
        _check_names(name, step_id, entry.input_map, signature.inputs, "is mapping to", "input")
        unmapped = [
            n for n, s in signature.inputs.items() if not s.optional and n not in entry.input_map
        ]
        if unmapped:
            raise InvalidArgument(
                f"in ensemble {name}, input {unmapped[0]} in model {step_id} is not mapped to "
                f"any ensemble tensors (unmapped: {unmapped})"
            )
        _check_names(
            name, entry.model_name, entry.output_map, signature.outputs, "is mapped from", "output"
        )
        for output, tensor in entry.output_map.items():
            spec = signature.outputs[output]
            tensors[tensor] = (
                spec.datatype,
                spec.dims,
                signature.full_shape(spec),
                f"step {index} (model '{entry.model_name}') output '{output}'",
            )
            writer[tensor] = index
        steps.append(
            Step(
                index,
                entry.model_name,
                step_version,
                entry.model_namespace,
                dict(entry.input_map),
                dict(entry.output_map),
                bool(model.config.model_transaction_policy.decoupled),
                signature.max_batch_size > 0,
                {n: signature.inputs[n].dims for n in entry.input_map},
            )
        )
        signatures.append(signature)

    for step, signature in zip(steps, signatures):
        for model_input, tensor in step.input_map.items():
            spec = signature.inputs[model_input]
            _check_edge(
                name, tensor, tensors.get(tensor), spec, signature, f"{step} input '{model_input}'"
            )
    for spec in own.outputs.values():
        _check_edge(
            name, spec.name, tensors.get(spec.name), spec, own, f"ensemble output '{spec.name}'"
        )

    producers = tuple(frozenset(writer[t] for t in step.input_map.values()) for step in steps)
    consumers = {
        p: tuple(i for i, ps in enumerate(producers) if p in ps)
        for p in (ENSEMBLE_INPUTS, *range(len(steps)))
    }
    return EnsemblePlan(
        name=name,
        version=version,
        steps=tuple(steps),
        inputs=tuple(own.inputs),
        outputs=tuple(own.outputs),
        output_dims={n: spec.dims for n, spec in own.outputs.items()},
        input_reshape=input_reshape,
        output_client_dims={n: declared.outputs[n].dims for n in output_reshape},
        batching=own.max_batch_size > 0,
        optional_inputs=frozenset(s.name for s in own.inputs.values() if s.optional),
        producers=producers,
        consumers=consumers,
        streaming=any(s.decoupled for s in steps)
        or bool(config.model_transaction_policy.decoupled),
        max_inflight_requests=config.ensemble_scheduling.max_inflight_requests,
    )


def _check_names(
    ensemble: str,
    step: str,
    mapping: Mapping[str, str],
    specs: Mapping[str, TensorSpec],
    verb: str,
    kind: str,
) -> None:
    for model_name, tensor in mapping.items():
        if model_name not in specs:
            raise InvalidArgument(
                f"in ensemble {ensemble}, ensemble tensor {tensor} {verb} non-existing {kind} "
                f"{model_name} in model {step} (its {kind}s: {sorted(specs)})"
            )


def _check_edge(
    ensemble: str,
    tensor: str,
    written: tuple[str, tuple[int, ...], list[int], str] | None,
    spec: TensorSpec,
    signature: ModelSignature,
    reader: str,
) -> None:
    """The tensor as written must have the datatype and a shape ``reader`` accepts:
    the same dims, or the same full shape (a tensor between a batching and a
    non-batching model, Triton's ValidateTensorConsistency in
    core src/ensemble_scheduler/ensemble_utils.cc)."""
    if written is None:  # structure errors are reported by validate_model_config
        raise InvalidArgument(f"ensemble '{ensemble}': no step writes tensor '{tensor}'")
    datatype, dims, shape, source = written
    if datatype != spec.datatype:
        raise InvalidArgument(
            f"ensemble '{ensemble}': data type mismatch for tensor '{tensor}': "
            f"{source} is {datatype}, but {reader} expects {spec.datatype}"
        )
    expected = signature.full_shape(spec)
    if not _compatible(list(dims), list(spec.dims)) and not _compatible(shape, expected):
        raise InvalidArgument(
            f"ensemble '{ensemble}': shape mismatch for tensor '{tensor}': {source} "
            f"has shape {_fmt(shape)}, but {reader} expects {_fmt(expected)}"
        )


def _compatible(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


class EnsembleModel:
    """The loaded form of an ensemble: its plan. It has no instances."""

    def __init__(self, plan: EnsemblePlan) -> None:
        self.plan = plan

    def create_instance(self, spec: InstanceSpec) -> NoReturn:
        raise InternalError(f"ensemble '{self.plan.name}' has no instances")

    def unload(self) -> None:
        pass


class EnsembleBackend(Backend):
    """Loads ``platform: "ensemble"``: checks the steps, on the Trio thread, against
    the composing models the server's inference path routes to."""

    name = "ensemble"

    def default_model_filename(self) -> str:
        return ""

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        pass  # an ensemble's tensors are what its config says

    def load(self, context: ModelContext) -> EnsembleModel:
        service = context.inference
        if service is None or not hasattr(service, "model"):
            raise Unavailable(
                f"ensemble '{context.name}' cannot be served: this server has no "
                "inference path to its composing models"
            )
        plan = trio.from_thread.run_sync(
            plan_ensemble, context.config, context.version, service.model
        )
        if plan.streaming:
            # An ensemble with a decoupled step is decoupled itself, whatever its
            # config says (core src/ensemble_scheduler/ensemble_utils.cc
            # ValidateEnsembleConfig: set_decoupled(decouple_label != 0)): clients
            # read it from the model's config, and a gRPC stream answers it as
            # responses come instead of in request order
            # (qa/L0_decoupled test_response_order, simple_repeat). An ensemble
            # declared decoupled keeps it here.
            context.config.model_transaction_policy.decoupled = True
            if context.config.response_cache.enable:
                # Decoupled now, it meets core's check of a decoupled model with
                # the cache (model_config_utils.cc ValidateModelConfig, DLIS-3916;
                # qa/L0_response_cache ensemble_cache_composing_decoupled).
                raise InvalidArgument(
                    f"Response Cache does not currently support model {context.name} "
                    "with 'decoupled' transaction policy. Please disable the response cache."
                )
        return EnsembleModel(plan)
