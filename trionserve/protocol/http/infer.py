"""``POST /v2/models/{name}[/versions/{v}]/infer``, the hot path of the HTTP
frontend: a compressed body inflated (never past --http-max-input-size), the
request decoded, inferred and its response encoded; TritonErrors answered with
their HTTP status and a JSON error."""

from __future__ import annotations

import gzip
import re
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import structlog
import trio

from trionserve.core.errors import InvalidArgument, Status, TritonError, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.parameters import check_forwarded_header
from trionserve.core.shared_memory import RequestRegions
from trionserve.dataplane import DataPlane
from trionserve.drain import ShuttingDown
from trionserve.lifecycle import Lifecycle
from trionserve.observability.logging import SETTINGS, log_infer_failed, verbose
from trionserve.observability.trace.frontend import HTTP_STAMPS
from trionserve.protocol.http import codec as http_codec
from trionserve.protocol.http import later
from trionserve.protocol.http.answer import (
    ANSWERED,
    BEGUN,
    CONNECTION_ANSWER,
    DISARMED,
    ConnectionAnswer,
)
from trionserve.protocol.http.h1 import CLOSE, JSON, Headers, RequestBody, Response

if TYPE_CHECKING:
    from trionserve.actors.model_lifecycle import ModelLifeCycle

log = structlog.get_logger(__name__)

# Triton's codes have HTTP statuses of their own, the rest are 400 (server
# src/http_server.cc HttpCodeFromError: "cases that has no direct matching code").
HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400,
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.INTERNAL: 500,
    Status.UNIMPLEMENTED: 501,
    Status.UNKNOWN: 400,
    Status.ALREADY_EXISTS: 400,
    Status.CANCELLED: 400,
    Status.DEADLINE_EXCEEDED: 504,
    Status.RESOURCE_EXHAUSTED: 503,
}

_BINARY_TYPE = (b"content-type", b"application/octet-stream")


def error_status(error: TritonError) -> int:
    return HTTP_STATUS.get(error.status, 500)


_INFER_TARGET = re.compile(rb"/v2/models/[^/?]+(?:/versions/[^/?]+)?/infer(?:\?|$)")


def body_too_large(
    target: bytes, headers: Headers, size: int | None, limit: int
) -> tuple[int, str]:
    """The status and message for a request body over --http-max-input-size, in
    Triton's words (server src/http_server.cc), though refused before the body is
    read (Triton reads it whole first); ``size`` None: a chunked body, past the
    limit and still coming.

    - an infer request with ``Inference-Header-Content-Length: 0``, its body a
      raw input: 400, "Raw input has a byte_size ..." (EVBufferToRawInput);
    - an infer request whose JSON header alone is over the limit, or any JSON
      body (an infer request without the header, every other endpoint): 400,
      "request JSON size of ..." (EVBufferToJson);
    - an infer request whose JSON header is within the limit and whose binary
      tensors take the body past it: 413. Triton does not bound binary tensor
      data at all (ParseJsonTritonIO appends it as it is); this server bounds
      every body it buffers.
    """
    flag = "Use --http-max-input-size to increase the limit."
    bytes_ = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    header: bytes | None = None
    if _INFER_TARGET.match(target):
        header = next((v for k, v in headers if k == b"inference-header-content-length"), None)
    if header is not None:
        try:
            json_length = int(header)
        except ValueError:
            json_length = -1  # the infer handler refuses it
        if json_length == 0:
            return 400, (
                f"Raw input has a byte_size ({bytes_}) that exceeds the maximum allowed "
                f"value of {limit} bytes. {flag}"
            )
        if 0 <= json_length <= limit:
            return 413, (
                f"the request body ({bytes_}) is larger than the limit of {limit} bytes "
                f"for binary tensor data (--http-max-input-size)"
            )
        if json_length > limit:
            bytes_ = f"{json_length} bytes"
    return 400, (
        f"request JSON size of {bytes_} exceeds the maximum allowed input size of "
        f"{limit} bytes. {flag}"
    )


# Compressed bodies larger than this are inflated in a worker thread, so that the
# event loop serves other connections meanwhile.
INFLATE_IN_THREAD_BYTES = 256 * 1024
# zlib window bits of each Content-Encoding: gzip's header, zlib's header.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decompress(body: RequestBody, encoding: str, limit: int | None) -> bytes:
    """``body`` inflated, never past ``limit`` bytes of output: a body that would
    inflate further is refused having produced at most ``limit + 1`` bytes (a
    decompression bomb costs no more memory than an honest body at the limit).
    Concatenated gzip members are inflated in turn. Raises InvalidArgument for an
    unknown encoding, corrupt or truncated data, or output past the limit."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise InvalidArgument(f"unsupported Content-Encoding '{encoding}'")
    parts: list[bytes] = []
    size = 0
    rest = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            room = 0 if limit is None else limit - size + 1
            part = inflater.decompress(rest, room)
            size += len(part)
            parts.append(part)
            if limit is not None and (size > limit or inflater.unconsumed_tail):
                # Triton's words (server src/data_compressor.h DecompressData).
                raise InvalidArgument(
                    "Decompressed data size exceeds the maximum allowed value of "
                    f"{limit} bytes. Use --http-max-input-size to increase the limit. "
                    f"(the {encoding} request body inflates past it)"
                )
            if not inflater.eof:
                raise InvalidArgument(
                    f"failed to decompress the {encoding} request body: it is truncated"
                )
            rest = inflater.unused_data
            if encoding != "gzip" or not rest:
                break
    except zlib.error as exc:
        raise InvalidArgument(f"failed to decompress the {encoding} request body: {exc}") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _compress(body: bytes, accept_encoding: str) -> tuple[bytes, bytes | None]:
    accepted = {part.split(";")[0].strip() for part in accept_encoding.split(",")}
    if "gzip" in accepted:
        return gzip.compress(body, compresslevel=1), b"gzip"
    if "deflate" in accepted:
        return zlib.compress(body, 1), b"deflate"
    return body, None


class _Again:
    """What a request's path, headers and JSON header said, for a request that repeats them
    (:meth:`InferHandler.handle`): its model's name and version, its body's size, the plan of
    its JSON header, its Accept-Encoding, and whether its answer may be written by the
    instance's thread (all but tracing, which is asked each time: see
    :meth:`InferHandler._answerable`)."""

    __slots__ = (
        "accept_encoding",
        "answerable",
        "header",
        "header_length",
        "headers",
        "match",
        "model",
        "name",
        "on_thread",
        "plan",
        "routed",
        "size",
        "version",
    )

    def __init__(
        self,
        match: re.Match[str],
        headers: Headers,
        size: int,
        header: bytes,
        plan: http_codec.Plan,
        name: str,
        version: int | None,
        accept_encoding: str | None,
        answerable: bool,
    ) -> None:
        self.match = match
        self.headers = headers
        self.size = size
        self.header = header
        self.header_length = len(header)
        self.plan = plan
        self.name = name
        self.version = version
        self.accept_encoding = accept_encoding
        self.answerable = answerable
        # The model version last routed to, whether its inputs are read on its threads only, and
        # the routes' generation that found it (-1: none; ModelLifeCycle.generation).
        self.model: object = None
        self.on_thread = False
        self.routed = -1


class InferHandler:
    """``POST /v2/models/{name}[/versions/{v}]/infer``: decode, infer, encode.

    ``handle`` is the whole request -> response step; the route table binds the
    path's match to it. It is the hot path: no per-request objects beyond the
    codec's.
    """

    def __init__(
        self,
        dataplane: DataPlane,
        verbose: bool = False,
        forward_headers: str | None = None,
        max_input_size: int | None = None,
        *,
        encode: Callable[..., Response] | None = None,
    ) -> None:
        self.dataplane = dataplane
        # The answer's encoder (SageMaker's port puts its own headers on it).
        self._encode: Callable[..., Response] = encode or encode_response
        self._tracing = dataplane.tracing
        # (nv_inference_first_response_histogram_ms is timed on the loop.)
        self._first_response = getattr(dataplane, "_first_response", False)
        self.verbose = verbose
        # The cap on a compressed body's inflated size (--http-max-input-size).
        self.max_input_size = max_input_size
        # --http-header-forward-pattern: matching headers become request parameters.
        self._forward = re.compile(forward_headers) if forward_headers else None
        # What the last request decoded from a plan said (a single slot: clients of one
        # shape share it).
        self._again: _Again | None = None
        # The registry's routes (their generation says when a kept routing is no longer the one
        # route() would find): set by the first _on_thread.
        self._routes: ModelLifeCycle | None = None

    async def handle(
        self,
        match: re.Match[str],
        request_headers: Headers,
        body: RequestBody,
        logged: bool = False,
    ) -> Response:
        """The response to one infer request: (status, headers, body chunks); with
        verbose logging, an access-log line once it is answered (protocol, model,
        HTTP status, latency)."""
        chatty = self.verbose or SETTINGS.log_verbose_level > 0
        if chatty and not logged:
            return await self._logged(match, request_headers, body)
        shared_memory: RequestRegions | None = None
        infer_request: InferenceRequest | None = None
        answer: ConnectionAnswer | None = None
        # A request that repeats the last one's path, headers and JSON header (a client
        # repeating its request) is decoded from what they said, once found valid.
        again = self._again
        if (
            again is not None
            and not chatty
            and again.match is match
            and again.headers == request_headers
            and len(body) == again.size
            and body[: again.header_length] == again.header
        ):
            try:
                infer_request, binary_output = http_codec.decode_planned(
                    again.plan, body, again.header_length, again.name, again.version, None
                )
                if self._forward is not None:
                    self._forward_headers(self._forward, request_headers, infer_request)
                answer = CONNECTION_ANSWER.get()
                if answer is not None and answer.later.view is not None:  # (in the socket)
                    routes = self._routes  # (_on_thread's kept answer, read here: no call)
                    if (
                        again.answerable
                        and not self._tracing.active
                        and (
                            again.on_thread
                            if routes is not None and again.routed == routes.generation
                            else self._on_thread(again)
                        )
                    ):
                        answer.later.defer()  # read by the instance's thread (later.py)
                    else:
                        answer.later.now()
                if self._tracing.active:  # the transport's HTTP_RECV_START ... (trace.frontend)
                    infer_request.trace_context = HTTP_STAMPS.get()
                    answer = None
                elif answer is not None and again.answerable:
                    answer.arm(infer_request, self._encode, binary_output)
                    begun = self.dataplane.begin_now(infer_request, "HTTP end point")
                    run = begun if isinstance(begun, Lifecycle) else await begun
                    if type(run) is Lifecycle:  # waited for by the connection's task (Carrier)
                        answer.carrier, answer.run = self, run
                        answer.run_binary_output = binary_output
                        answer = None  # (settled as it is carried on)
                        return BEGUN
                    response = cast("InferenceResponse", run)  # (the response cache's)
                else:
                    answer = None
                if answer is None:
                    response = await self.dataplane.infer(infer_request, endpoint="HTTP end point")
                else:
                    settled, answer = answer.settle(), None  # (settled: not again below)
                    if settled != DISARMED:
                        return ANSWERED  # the instance's thread wrote it (or began to)
                return self._encode(
                    response, infer_request, binary_output, None, again.accept_encoding
                )
            except Exception as exc:
                return self._failed(exc, answer, infer_request)
            finally:
                if answer is not None:
                    answer.settle()  # (cancelled: the thread writes nothing after this)
        header_field: bytes | None = None
        header_length: int | None = None
        content_encoding = None
        accept_encoding = None
        for key, value in request_headers:
            if key == b"inference-header-content-length":
                header_field = value
            elif key == b"content-encoding":
                content_encoding = value.decode("latin-1").strip().lower()
            elif key == b"accept-encoding":
                accept_encoding = value.decode("latin-1")
        try:
            connection = CONNECTION_ANSWER.get()
            if connection is not None and connection.later.view is not None:
                connection.later.now()  # (binary tensors left in the socket: read before use)
            if content_encoding and content_encoding != "identity":
                limit = self.max_input_size
                if len(body) > INFLATE_IN_THREAD_BYTES:
                    body = await trio.to_thread.run_sync(decompress, body, content_encoding, limit)
                else:
                    body = decompress(body, content_encoding, limit)
            if header_field is not None:
                try:
                    header_length = int(header_field)
                except ValueError:
                    raise InvalidArgument(
                        "Inference-Header-Content-Length must be an integer, got "
                        f"{header_field.decode('latin-1')!r}"
                    ) from None
            version = http_codec.parse_model_version(match.group(2) or "")
            shared_memory = self.dataplane.request_regions()
            name = match.group(1)
            if header_length == 0:  # a raw binary request: the body is the one input
                signature = self.dataplane.model(name, version).signature
                infer_request = http_codec.decode_raw_request(body, name, version, signature)
                binary_output = True  # all its outputs are binary, as in Triton
            else:
                infer_request, binary_output = http_codec.decode_infer_request(
                    body, header_length, name, version, shared_memory
                )
            if self._forward is not None:
                self._forward_headers(self._forward, request_headers, infer_request)
            if chatty and verbose():
                log.debug("infer request", model=infer_request.model_name, id=infer_request.id)
            if self._tracing.active:  # the transport's HTTP_RECV_START ... (trace.frontend)
                infer_request.trace_context = HTTP_STAMPS.get()
            answer = CONNECTION_ANSWER.get()
            if (
                answer is not None
                and not chatty
                and self._answerable(infer_request, shared_memory, accept_encoding)
            ):
                answer.arm(infer_request, self._encode, binary_output)
            else:
                answer = None
            if not chatty and content_encoding is None and header_length:
                self._again = self._keep(
                    match, request_headers, body, header_length, infer_request, accept_encoding
                )
            response = await self.dataplane.infer(infer_request, endpoint="HTTP end point")
            if answer is not None:
                settled, answer = answer.settle(), None  # (settled: not again below)
                if settled != DISARMED:
                    return ANSWERED  # the instance's thread wrote it (or began to)
            return self._encode(
                response, infer_request, binary_output, shared_memory, accept_encoding
            )
        except Exception as exc:
            return self._failed(exc, answer, infer_request)
        finally:
            if answer is not None:
                answer.settle()  # (cancelled: the thread writes nothing after this)
            if shared_memory is not None:
                shared_memory.release()

    def _keep(
        self,
        match: re.Match[str],
        request_headers: Headers,
        body: RequestBody,
        header_length: int,
        request: InferenceRequest,
        accept_encoding: str | None,
    ) -> _Again | None:
        """What a request that repeats this one (its path, headers and JSON header) is decoded
        from, if it was decoded from a plan (every input binary, no shared memory); None."""
        header = bytes(body[:header_length])
        plan = http_codec.planned(header, len(body))
        if plan is None:
            return None
        outputs = request.requested_outputs
        answerable = (
            not self._first_response
            and (not accept_encoding or accept_encoding.strip() == "identity")
            and (outputs is None or not any(o.parameters.get("classification") for o in outputs))
        )
        return _Again(
            match,
            list(request_headers),  # (a copy: the handler's caller owns the list)
            len(body),
            header,
            plan,
            request.model_name,
            request.model_version,
            accept_encoding,
            answerable,
        )

    def _on_thread(self, again: _Again) -> bool:
        """Whether nothing reads the inputs of ``again``'s model before its instance's thread
        (:func:`~trionserve.protocol.http.later.on_thread`), decided once for the version routed
        to and kept until the routes change (a load, unload, eviction, or a name's meaning)."""
        routes = self._routes
        if routes is not None and again.routed == routes.generation:
            return again.on_thread
        routes = self._routes = self.dataplane.registry.lifecycle
        generation = routes.generation
        try:
            model = self.dataplane.model(again.name, again.version)
        except TritonError:
            return False  # (begin says why, or loads it)
        if again.model is not model:
            again.model, again.on_thread = model, later.on_thread(model)
        again.routed = generation
        return again.on_thread

    # -- carried on by the connection's task (answer.Carrier) ---------------------------

    def carry_on(self, answer: ConnectionAnswer, run: Lifecycle, binary_output: bool) -> Response:
        """The answer of a request this handler began, its outcome in: ANSWERED
        where the instance's thread wrote it."""
        request = run.request
        try:
            response = self.dataplane.end(run)
            if answer.settle() != DISARMED:
                return ANSWERED  # the instance's thread wrote it (or began to)
            return self._encode(response, request, binary_output)
        except Exception as exc:
            return self._failed(exc, answer, request)

    async def finish(
        self, answer: ConnectionAnswer, run: Lifecycle, binary_output: bool
    ) -> Response:
        """:meth:`carry_on` for a request whose outcome is not in yet (the wait ended
        on the socket first: pipelined bytes, the client's end): awaited."""
        request = run.request
        try:
            response = await self.dataplane.finish(run)
            if answer.settle() != DISARMED:
                return ANSWERED
            return self._encode(response, request, binary_output)
        except Exception as exc:
            return self._failed(exc, answer, request)
        except BaseException:
            answer.settle()  # (cancelled: the thread writes nothing after this)
            raise

    def failed(self, answer: ConnectionAnswer, run: Lifecycle, exc: Exception) -> Response:
        """The answer's wait raised: the request dropped, its error answered."""
        self.dataplane.drop(run)
        return self._failed(exc, answer, run.request)

    def drop(self, answer: ConnectionAnswer, run: Lifecycle) -> None:
        """The connection's task is cancelled: the request dropped, the answer settled."""
        self.dataplane.drop(run)
        answer.settle()  # (the thread writes nothing after this)

    def _failed(
        self,
        exc: Exception,
        answer: ConnectionAnswer | None,
        infer_request: InferenceRequest | None,
    ) -> Response:
        """The answer to a request that failed: none where the thread's answer is on the wire
        (the client has it), else its error's (a bug's: 500, logged)."""
        if answer is not None and answer.settle() != DISARMED:
            return ANSWERED
        if isinstance(exc, TritonError):
            log_infer_failed(infer_request.id if infer_request else None, exc.message)
            return error_response(exc)
        log.exception("infer handler failed")  # (a bug must not take the connection task down)
        return error_response(as_triton_error(exc, "internal error"))

    async def _logged(
        self, match: re.Match[str], request_headers: Headers, body: RequestBody
    ) -> Response:
        """:meth:`handle` with its access-log line."""
        started = time.perf_counter()
        response = await self.handle(match, request_headers, body, logged=True)
        log.debug(
            "infer response",
            protocol="HTTP",
            model=match.group(1),
            status=response[0],
            latency_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return response

    def _answerable(
        self,
        request: InferenceRequest,
        shared_memory: RequestRegions | None,
        accept_encoding: str | None,
    ) -> bool:
        """Whether the instance's thread may write this request's answer (see
        :mod:`~trionserve.protocol.http.answer`): nothing but the encoding
        between the backend's response and the client (no trace, access log,
        first-response time, classification, compression), no shared memory;
        the caller checked the access log."""
        if self._tracing.active or self._first_response:
            return False
        if accept_encoding and accept_encoding.strip() != "identity":
            return False
        if shared_memory is not None and shared_memory.held:
            return False
        outputs = request.requested_outputs
        return outputs is None or not any(o.parameters.get("classification") for o in outputs)

    @staticmethod
    def _forward_headers(
        pattern: re.Pattern[str], request_headers: Headers, request: InferenceRequest
    ) -> None:
        """Headers whose name matches the pattern, as string parameters (a parameter
        the request sets itself wins, as over gRPC)."""
        for key, value in request_headers:
            name = key.decode("latin-1")
            if pattern.search(name):
                check_forwarded_header(name)
                request.parameters.setdefault(name, value.decode("latin-1"))


def encode_response(
    response: InferenceResponse,
    infer_request: InferenceRequest,
    binary_output: bool,
    shared_memory: RequestRegions | None = None,
    accept_encoding: str | None = None,
) -> Response:
    """The 200 answer to an infer request: its response encoded (JSON, binary
    tensors after it), compressed where ``accept_encoding`` asks. Called on the
    instance's thread too (see :mod:`~trionserve.protocol.http.answer`), with
    neither shared memory nor compression: nothing here may touch Trio."""
    chunks, json_length = http_codec.encode_infer_response(
        response, infer_request, shared_memory, binary_output=binary_output
    )
    if json_length is None:
        headers = [JSON]
    else:
        headers = [_BINARY_TYPE, (b"inference-header-content-length", b"%d" % json_length)]
    total = 0
    for chunk in chunks:
        total += len(chunk)
    if accept_encoding and "identity" != accept_encoding.strip():
        payload, encoding = _compress(b"".join(chunks), accept_encoding)
        if encoding is not None:
            chunks, total = [payload], len(payload)
            headers.append((b"content-encoding", encoding))
    headers.append((b"content-length", b"%d" % total))
    return 200, headers, chunks


def error_response(error: TritonError) -> Response:
    body = http_codec.encode_error(error.message)
    headers = [JSON, (b"content-length", b"%d" % len(body))]
    if isinstance(error, ShuttingDown):
        # Refused because the server is draining: the client should take its next
        # request elsewhere (another replica), so the connection is not kept.
        headers.append(CLOSE)
    return error_status(error), headers, [body]
