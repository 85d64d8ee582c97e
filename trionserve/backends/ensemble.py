"""The ensemble platform at load time: an ensemble's steps checked against its models.

An ensemble (``platform: "ensemble"``) has no model file and no instances; loading
it means checking its ``ensemble_scheduling`` steps against the composing models
that serve now and turning them into an :class:`EnsemblePlan`, which the
:class:`~trionserve.schedulers.ensemble.EnsembleScheduler` runs. The configuration's
own structure (each tensor written once, no cycles, inputs and outputs mapped) is
checked earlier by ``validate_model_config``; here come the checks that need the
composing models: each exists and has the version a step names, and the steps
agree with the models' configs (mapped names, data types, shapes, decoupled
branches: :func:`~trionserve.backends.ensemble_graph.validate_ensemble`, Triton's
``ValidateEnsembleConfig``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

import trio

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.ensemble_graph import validate_ensemble
from trionserve.core.errors import InternalError, InvalidArgument, TritonError, Unavailable
from trionserve.core.validation import ModelSignature, TensorSpec

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelEnsembling

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
    # Triton checks that each step's model has the versions the step names
    # (model_repository_manager.cc:1874-1911, CheckNode), then the steps against
    # the models' completed configs (ensemble_utils.cc ValidateEnsembleConfig).
    models = [_composing(name, entry, lookup) for entry in config.ensemble_scheduling.step]
    validate_ensemble(config, [model.config for model in models])
    writer: dict[str, int] = {spec.name: ENSEMBLE_INPUTS for spec in own.inputs.values()}
    steps: list[Step] = []
    for index, (entry, model) in enumerate(zip(config.ensemble_scheduling.step, models)):
        signature: ModelSignature = model.signature
        for tensor in entry.output_map.values():
            writer[tensor] = index
        steps.append(
            Step(
                index,
                entry.model_name,
                entry.model_version if entry.model_version > 0 else None,
                entry.model_namespace,
                dict(entry.input_map),
                dict(entry.output_map),
                bool(model.config.model_transaction_policy.decoupled),
                signature.max_batch_size > 0,
                {n: signature.inputs[n].dims for n in entry.input_map if n in signature.inputs},
            )
        )
    for step in steps:
        for tensor in step.input_map.values():
            if tensor not in writer:  # validate_model_config reports it first
                raise InvalidArgument(f"ensemble '{name}': no step writes tensor '{tensor}'")

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


def _composing(ensemble: str, step: ModelEnsembling.Step, lookup: Lookup) -> ComposingModel:
    """The model a step calls, or Triton's words for why the ensemble cannot
    have it (model_repository_manager.cc:1874-1908, CheckNode), the reason after."""
    version = step.model_version if step.model_version > 0 else None
    step_id = (
        f"{step.model_namespace}::{step.model_name}" if step.model_namespace else (step.model_name)
    )
    try:
        return lookup(step.model_name, version, step.model_namespace)
    except TritonError as exc:
        reason = exc.message
    if version is not None:
        try:
            lookup(step.model_name, None, step.model_namespace)
        except TritonError:
            pass
        else:
            raise InvalidArgument(
                f"ensemble '{ensemble}' depends on '{step_id}' whose required version "
                f"{version} is not loaded. ({reason})"
            )
    raise InvalidArgument(
        f"ensemble '{ensemble}' depends on '{step_id}' which has no loaded version. ({reason})"
    )


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
        # An ensemble with a decoupled step is decoupled itself, whatever its
        # config says (core src/ensemble_scheduler/ensemble_utils.cc:364
        # ValidateEnsembleConfig: set_decoupled(decouple_label != 0), which also
        # puts model_transaction_policy in every ensemble's config, as clients
        # read it): a gRPC stream answers it as responses come instead of in
        # request order (qa/L0_decoupled test_response_order, simple_repeat). An
        # ensemble declared decoupled keeps it here.
        context.config.model_transaction_policy.decoupled = plan.streaming
        if plan.streaming:
            if context.config.response_cache.enable:
                # Decoupled now, it meets core's check of a decoupled model with
                # the cache (model_config_utils.cc ValidateModelConfig, DLIS-3916;
                # qa/L0_response_cache ensemble_cache_composing_decoupled).
                raise InvalidArgument(
                    f"Response Cache does not currently support model {context.name} "
                    "with 'decoupled' transaction policy. Please disable the response cache."
                )
        return EnsembleModel(plan)
