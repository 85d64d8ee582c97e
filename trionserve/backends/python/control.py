"""The model loading API of Python models: ``pb_utils.load_model``, ``unload_model``
and ``is_model_ready``, answered on the server's side.

As in Triton, loading and unloading need the server in EXPLICIT model control
mode (the DataPlane says so otherwise); a model may not load or unload itself.
Requests come from a stub as ``control`` messages: on the Trio loop while the
model serves, or on the worker thread that waits for the stub while it
initializes or finalizes (then the call is carried to the Trio loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import trio

from trionserve.core.errors import InvalidArgument, TritonError, Unavailable

if TYPE_CHECKING:
    from trionserve.backends.base import InferenceService


@runtime_checkable
class ModelLoading(Protocol):
    """The model loading API of the server's inference service (the DataPlane's
    model-facing view has it)."""

    def model_ready(self, name: str, version: int | None) -> bool: ...
    async def load_model(
        self, name: str, config_override: str | None = None, files: dict[str, bytes] | None = None
    ) -> None: ...
    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...


class ModelControl:
    """The model loading API for the stubs of one model."""

    def __init__(self, inference: InferenceService | None, model_name: str) -> None:
        self._inference = inference
        self._model_name = model_name

    async def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """A stub's ``control`` message; the reply it waits for."""
        try:
            result = await self._apply(message)
        except TritonError as exc:
            return _reply(message, None, exc.message)
        return _reply(message, result, None)

    def handle_blocking(self, message: dict[str, Any]) -> dict[str, Any]:
        """``handle`` from a worker thread (a stub initializing or finalizing)."""
        try:
            return trio.from_thread.run(self.handle, message)
        except (RuntimeError, trio.RunFinishedError):
            # Not a Trio worker thread (a model closed from the loop itself), or
            # the server has stopped: nothing can be loaded any more.
            return _reply(
                message,
                None,
                "the model loading API is not available while the server closes this model",
            )

    async def _apply(self, message: dict[str, Any]) -> bool | None:
        inference = self._inference
        if not isinstance(inference, ModelLoading):
            raise Unavailable(
                "the model loading API is not available: the server gave "
                "this backend no inference service with it"
            )
        action, name = message["action"], message["name"]
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"model_name must be a non-empty string, not {name!r}")
        if action == "ready":
            version = message["version"]
            try:
                number = int(version) if version not in ("", None) else None
            except (TypeError, ValueError):
                raise InvalidArgument(
                    f"model_version must be a version number, not {version!r}"
                ) from None
            return inference.model_ready(name, number)
        if name == self._model_name:
            raise InvalidArgument(f"model '{name}' cannot load or unload itself")
        if action == "load":
            config, files = message["config"], message["files"]
            if not isinstance(config, str):
                raise InvalidArgument("config must be a JSON string")
            if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, (bytes, bytearray)) for k, v in files.items()
            ):
                raise InvalidArgument("files must map 'file:<version>/<name>' strings to bytes")
            contents = {key: bytes(value) for key, value in files.items()}
            await inference.load_model(name, config or None, contents)
            return None
        if action == "unload":
            await inference.unload_model(name, bool(message["unload_dependents"]))
            return None
        raise InvalidArgument(f"unknown model control action {action!r}")


def _reply(message: dict[str, Any], result: bool | None, error: str | None) -> dict[str, Any]:
    return {"op": "control_reply", "call": message["call"], "result": result, "error": error}
