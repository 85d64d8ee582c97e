"""What the two kinds of Python model instance do alike on the server's side: a
stub's (``instance.PythonInstance``) and an in-process one
(``inprocess.InProcessInstance``). The arguments the model's ``initialize`` gets
(python_backend src/python_be.cc, ModelInstanceState::LaunchStubProcess) and the
delivery of what a model sends, into the request (Triton's response factory)."""

from __future__ import annotations

from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.core.errors import InternalError, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse


def initialize_args(context: ModelContext, spec: InstanceSpec, config_json: str) -> dict[str, str]:
    """The ``args`` of the model's ``initialize``, as Triton passes them."""
    return {
        "model_config": config_json,
        "model_instance_kind": spec.kind.removeprefix("KIND_"),
        "model_instance_name": spec.name,
        "model_instance_device_id": str(spec.device_id),
        "model_repository": str(context.model_dir),
        "model_version": str(context.version),
        "model_name": context.name,
    }


def deliver(
    request: InferenceRequest, outcome: InferenceResponse | TritonError | None, final: bool = True
) -> None:
    """A response, or an error, which ends the request (InferenceRequest has no
    errors that are not final)."""
    if isinstance(outcome, TritonError):
        request.fail(outcome)
    else:
        request.send(outcome, final=final)


def deliver_sent(
    request: InferenceRequest,
    outcome: InferenceResponse | TritonError | None,
    final: bool,
    decoupled: bool,
) -> None:
    """A response (or the final flag alone) the model sent through a response
    sender. A model that is not decoupled has one response (its sender refuses a
    second), so it is the final outcome whatever the flag; such a model sending
    the final flag before any response gets Triton's error."""
    if outcome is not None:
        deliver(request, outcome, final or not decoupled)
    elif final:
        if decoupled:
            request.send(None, final=True)
        else:
            request.fail(
                InternalError(
                    "Unable to send response. Non-decoupled model cannot send complete "
                    "final before sending a response."
                )
            )
