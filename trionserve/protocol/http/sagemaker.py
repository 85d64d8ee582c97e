"""Amazon SageMaker's endpoints, on their own port (``--allow-sagemaker``,
``--sagemaker-port``): Triton's SageMaker frontend (server src/sagemaker_server.cc,
src/sagemaker_server.h), served by the HTTP frontend's transport, handlers and
limits (``--http-max-input-size``, ``--http-restricted-api``, as Triton's main.cc
StartSagemakerService "reuse[s] HTTP server settings").

- ``GET /ping``: the server's readiness, as ``/v2/health/ready`` answers it (200 or
  400, no body; 503 while draining); with ``SAGEMAKER_TRITON_PING_MODE=live``, its
  liveness (sagemaker_server.cc:157, http_server.cc HandleServerHealth).
- ``POST /invocations``: an infer request to the model named by
  ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME`` (default
  ``unspecified_SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``, which no repository holds,
  so the request is answered the unknown model's error), the body and answers of
  ``/v2/models/<m>/infer`` (sagemaker_server.cc:162). ``SAGEMAKER_TRITON_INFERENCE_TYPE``
  ``generate`` / ``generate_stream`` make it the generate endpoints instead.
  Binary tensors: SageMaker does not read ``Inference-Header-Content-Length``; the
  JSON header's size comes in the content type
  ``application/vnd.sagemaker-triton.binary+json;json-header-size=<n>``, and a
  binary answer carries it the same way (sagemaker_server.cc:76-149, which
  overrides GetInferenceHeaderLength and SetResponseHeader). Bodies are never
  compressed (sagemaker_server.h: both compression types are IDENTITY).
- ``/models``, ``/models/<name>``, ``/models/<name>/invoke`` (the multi-model
  endpoint: load a model from a directory, list, describe, invoke, unload):
  :mod:`~trionserve.protocol.http.sagemaker_mme`, served as Triton's binary serves
  it (whenever the SageMaker port is on), from directories under
  ``--sagemaker-multi-model-root`` only (an empty root turns it off); a method
  other than GET, POST or DELETE 400.
- Any other path: 400 with no body (sagemaker_server.cc:269-273).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from functools import partial

import trio

from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.shared_memory import RequestRegions
from trionserve.dataplane import DataPlane
from trionserve.protocol.http.frontend import (
    HttpFrontend,
    HttpOptions,
    InferHandler,
    _answer,
    _json,
    refuse_large_body,
)
from trionserve.protocol.http.infer import encode_response, error_response
from trionserve.protocol.http.sagemaker_mme import DEFAULT_ROOT, MultiModelEndpoint, mme_disabled
from trionserve.protocol.http.transport import Handler, Headers, HttpServer, RequestBody, Response
from trionserve.protocol.restricted import RestrictedCategory

# sagemaker_server.cc:73
BINARY_MIME_TYPE = "application/vnd.sagemaker-triton.binary+json;json-header-size="
_BINARY_MIME = BINARY_MIME_TYPE.encode()
_MODELS_PATH = re.compile(r"/models(?:/)?([^/]+)?(/invoke)?")  # sagemaker_server.h
_BAD_REQUEST: Response = (400, [(b"content-length", b"0")], ())
INFERENCE_TYPES = ("infer", "generate", "generate_stream")
_DROPPED = (b"inference-header-content-length", b"content-encoding", b"accept-encoding")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass(frozen=True)
class SagemakerOptions:
    """The SageMaker port and Triton's environment variables for it (read when
    the options are made, as Triton reads them when its frontend starts)."""

    port: int = 8080  # --sagemaker-port
    address: str = "0.0.0.0"  # Triton has no flag for it (command_line_parser.h)
    model_name: str = field(
        default_factory=partial(
            _env,
            "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME",
            "unspecified_SAGEMAKER_TRITON_DEFAULT_MODEL_NAME",
        )
    )
    ping_mode: str = field(default_factory=partial(_env, "SAGEMAKER_TRITON_PING_MODE", "ready"))
    inference_type: str = field(
        default_factory=partial(_env, "SAGEMAKER_TRITON_INFERENCE_TYPE", "infer")
    )
    # The multi-model endpoint: on, as Triton's binary serves it with the SageMaker
    # port (sagemaker_server.cc:185-266 routes /models whatever the environment),
    # loading only from directories under the root (--sagemaker-multi-model-root;
    # the command line turns it off with an empty root).
    multi_model: bool = True
    multi_model_root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        if self.inference_type not in INFERENCE_TYPES:
            raise ValueError(
                f"invalid SAGEMAKER_TRITON_INFERENCE_TYPE '{self.inference_type}': must be "
                "one of: infer, generate, generate_stream"
            )


def header_length(headers: Headers, content_length: int) -> int | None:
    """The JSON header's size from the content type, None where it is not the
    binary one (then the whole body is JSON), in Triton's words when it is wrong
    (sagemaker_server.cc:76-132)."""
    content_type = b""
    for key, value in headers:
        if key == b"content-type":
            content_type = value
    pos = content_type.find(_BINARY_MIME)
    if pos < 0:
        return None
    text = content_type.decode("latin-1")
    if pos != 0:
        raise InvalidArgument(
            f"expect MIME type for binary data starts with '{BINARY_MIME_TYPE}', got: {text}"
        )
    size = text[len(BINARY_MIME_TYPE) :]
    match = re.match(r"\s*[+-]?\d+", size)  # std::stoi: leading digits
    if match is None:
        raise InvalidArgument(f"Unable to parse inference header size, got: {size}")
    parsed = int(match.group())
    if parsed < 0 or parsed > content_length:
        raise InvalidArgument(
            f"inference header size should be in range (0, {content_length}), got: {size}"
        )
    return parsed


def encode_invocation(
    response: InferenceResponse,
    infer_request: InferenceRequest,
    binary_output: bool,
    shared_memory: RequestRegions | None = None,
    accept_encoding: str | None = None,
) -> Response:
    """The infer answer with SageMaker's headers: a binary answer's JSON size in
    its content type (SagemakeInferRequestClass::SetResponseHeader), never
    compressed. Runs on the instance's thread too (as encode_response)."""
    status, headers, chunks = encode_response(response, infer_request, binary_output, shared_memory)
    for index, (key, value) in enumerate(headers):
        if key == b"inference-header-content-length":
            del headers[index]
            headers[0] = (b"content-type", _BINARY_MIME + value)
            break
    return status, headers, chunks


class SagemakerFrontend:
    """The router of the SageMaker port, over the HTTP frontend's handlers."""

    def __init__(self, http: HttpFrontend, options: SagemakerOptions) -> None:
        self.http = http
        self.options = options
        infer = http.infer
        self.infer = InferHandler(
            http.dataplane, infer.verbose, None, infer.max_input_size, encode=encode_invocation
        )
        # The default model as the infer path's match (name, no version).
        self._model = _model_match(options.model_name)
        self.mme: MultiModelEndpoint | None = None
        if options.multi_model:
            self.mme = MultiModelEndpoint(
                http.dataplane, options.multi_model_root, self.infer_on, http._checked
            )
        self._mme_off = mme_disabled()
        self._mme_load_off = mme_disabled(load=True)

    def route(self, method: bytes, path: str) -> Handler:
        checked = self.http._checked
        if method == b"HEAD":
            method = b"GET"
        if path == "/ping":
            if method != b"GET":
                return checked(RestrictedCategory.HEALTH, _refusal(405, "Method Not Allowed"))
            return checked(RestrictedCategory.HEALTH, self.ping)
        if path == "/invocations":
            if method != b"POST":
                return checked(RestrictedCategory.INFERENCE, _refusal(405, "Method Not Allowed"))
            return checked(RestrictedCategory.INFERENCE, self.invocations)
        match = _MODELS_PATH.fullmatch(path)
        if match is None or method not in (b"GET", b"POST", b"DELETE"):
            return partial(_answer, _BAD_REQUEST)
        name, invoke = match.groups()
        if self.mme is not None:
            return self.mme.route(method, name or "", bool(invoke))
        if method == b"POST" and invoke:
            return self._mme_off
        off = self._mme_load_off if method == b"POST" else self._mme_off
        return checked(RestrictedCategory.MODEL_REPOSITORY, off)

    async def ping(self, headers: Headers, body: RequestBody) -> Response:
        if self.options.ping_mode == "live":
            return await self.http.health_live(None, headers, body)  # type: ignore[arg-type]
        return await self.http.health_ready(None, headers, body)  # type: ignore[arg-type]

    async def invocations(self, headers: Headers, body: RequestBody) -> Response:
        """The default model's infer (or generate) request: the content type's JSON
        size as the infer handler's Inference-Header-Content-Length, compression
        and the client's own header length ignored (as Triton's SageMaker server)."""
        kind = self.options.inference_type
        if kind != "infer":
            handler = HttpFrontend.generate if kind == "generate" else HttpFrontend.generate_stream
            return await self.http._guarded(handler, self._model, headers, body)
        return await self.infer_on(self._model, headers, body)

    async def infer_on(
        self, model: re.Match[str] | str, headers: Headers, body: RequestBody
    ) -> Response:
        """An infer request on ``model`` with SageMaker's headers: the content
        type's JSON size as the infer handler's Inference-Header-Content-Length;
        compression and the client's own header length ignored."""
        if isinstance(model, str):
            model = _model_match(model)
        dataplane = self.http.dataplane
        try:
            # The model first, then the body: Triton asks for the model's
            # transaction properties before reading it (sagemaker_server.cc:446-460,
            # http_server.cc HandleInfer), so an unknown model is the answer to
            # any body. (Not where models load on demand: the infer loads them.)
            if dataplane.registry.residency is None:
                dataplane.model(model.group("name"), None)
            length = header_length(headers, len(body))
        except TritonError as error:
            return error_response(error)
        kept = [(key, value) for key, value in headers if key not in _DROPPED]
        if length is not None:
            kept.append((b"inference-header-content-length", b"%d" % length))
        return await self.infer.handle(model, kept, body)


def _model_match(name: str) -> re.Match[str]:
    """A model name as the infer path's match (name, no version)."""
    match = re.fullmatch(r"(?P<name>.*)(?P<version>)", name, re.S)
    assert match is not None
    return match


def _refusal(status: int, message: str) -> Handler:
    return partial(_answer, _json({"error": message}, status))


async def serve_sagemaker(
    dataplane: DataPlane,
    address: str,
    port: int,
    shutdown: trio.Event,
    graceful_timeout: float,
    verbose: bool,
    http: HttpOptions,
    options: SagemakerOptions,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve SageMaker's endpoints until ``shutdown`` is set, with the HTTP port's
    limits and restricted APIs, then drain for ``graceful_timeout``."""
    frontend = HttpFrontend(dataplane, verbose, None, http.max_input_size, http.restricted_apis)
    transport = replace(
        http.transport_options(reuse_port=False),
        body_refusal=refuse_large_body,
        budget=dataplane.budget,
        tracing=dataplane.tracing,
    )
    server = HttpServer(SagemakerFrontend(frontend, options).route, transport)
    await server.serve(address, port, shutdown, graceful_timeout, task_status=task_status)
