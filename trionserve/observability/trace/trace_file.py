"""A sampled request's :class:`Trace`, Triton's trace files (trace mode ``triton``)
and the task that writes them.

A trace collects timestamps from Trio's clock, in nanoseconds: REQUEST_START and
REQUEST_END around the data plane's work, QUEUE_START from the time the scheduler
took the request, and COMPUTE_START / COMPUTE_INPUT_END / COMPUTE_OUTPUT_START /
COMPUTE_END from the measurements the executor already takes for the statistics;
the frontend's own (HTTP_RECV_START ..., :mod:`.frontend`) where Triton writes
them, the HTTP RECV pair ahead of the head, the rest after REQUEST_END.
Finished traces are written as Triton writes them: a JSON array of
``{"id", "model_name", "model_version"}`` and ``{"id", "timestamps": [...]}``
objects, into ``trace_file`` at shutdown, or with ``log_frequency`` N into
``trace_file.0``, ``trace_file.1``, ... every N traces (and when ``trace_count``
runs out). Files are written by :class:`TraceFileWriter`'s task in a worker
thread, never on the Trio loop. What waits for it is bounded by bytes
(``MAX_QUEUED_TRACE_BYTES``), and one name has at most ``MAX_TRACE_FILES``
indexed files; later chunks are appended to the main file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TextIO, TypeVarTuple

import numpy as np
import structlog
import trio

from trionserve.observability.trace.settings import TraceSetting

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.observability.trace.frontend import FrontendStamps

_Args = TypeVarTuple("_Args")
# A chunk for the writer's thread: a write, its arguments and the bytes it holds.
_Job = tuple[Callable[..., None], tuple[object, ...], int]

log = structlog.get_logger(__name__)

# Finished chunks waiting for the writer; beyond it a chunk is written in place.
_WRITE_QUEUE = 256
# Bytes of trace text waiting for the writer; beyond it a chunk is written in
# place (a client can turn TENSORS tracing on: each trace then holds its tensors
# as text, about 5 bytes per byte of FP32 data). Triton has no such bound.
MAX_QUEUED_TRACE_BYTES = 16 << 20
# Indexed files (``trace_file.N``, log_frequency) one trace file name may have;
# later chunks are appended to ``trace_file`` itself (a client setting
# log_frequency 1 would make one file per request). Triton has no such bound.
MAX_TRACE_FILES = 1000


class _NotTraced:
    def __repr__(self) -> str:
        return "NOT_TRACED"


# The trace_context of a request a model or an ensemble made for a request that
# is not traced: it is not sampled either. Triton samples only the requests its
# frontends receive (server src/http_server.cc StartTrace, src/grpc/
# infer_handler.cc: TraceManager::SampleTrace); a request made inside the server
# is traced only as the child of a traced one (core ensemble_scheduler.cc,
# python_backend BLS given ``trace=request.trace()``).
NOT_TRACED = _NotTraced()


def clock_ns(seconds: float) -> int:
    """Trio's clock as integer nanoseconds: every trace timestamp is on this clock."""
    return int(seconds * 1_000_000_000)


# -- traces -----------------------------------------------------------------------------


class Trace:
    """The activities of one sampled request, in the order they happened."""

    __slots__ = (
        "id",
        "parent_id",
        "setting",
        "model_name",
        "model_version",
        "request_id",
        "events",
        "tensors",
        "frontend",
        "holders",
        "context",
        "otel",
        "running",
        "finish_later",
    )

    def __init__(
        self,
        id: int,
        setting: TraceSetting,
        model_name: str,
        model_version: int,
        request_id: str,
        parent_id: int | None = None,
    ) -> None:
        self.id = id
        # The trace of the request that made this one (an ensemble's), if any.
        self.parent_id = parent_id
        self.setting = setting
        self.model_name = model_name
        self.model_version = model_version
        self.request_id = request_id
        self.events: list[tuple[str, int]] = []
        self.tensors: list[dict] | None = [] if "TENSORS" in setting.level else None
        # The frontend's timestamps (a FrontendStamps) when it took them, and how
        # many of the data plane and the frontend are not done with the trace:
        # it is written when none is (Triton: the last reference goes).
        self.frontend: FrontendStamps | None = None
        self.holders = 1
        # The trace context Triton's tracer sets at REQUEST_START in mode
        # opentelemetry, handed to Python models (``request.trace().get_context()``):
        # ``{"traceparent":"00-<trace id>-<model span id>-01"}`` (server
        # src/tracer.cc:568-585, :710-730); None in mode triton. ``otel``: the ids
        # of its spans, (trace id, model span id, the model span's parent span id,
        # the root InferRequest span id or 0 for a child trace, the client's
        # tracestate header or "").
        self.context: str | None = None
        self.otel: tuple[int, int, int, int, str] | None = None
        # Its model still runs the request, answered already (its caller was
        # cancelled while it ran the request in the caller's task): the trace's
        # end waits for the compute (``finish_later``, see settle_compute).
        self.running = False
        self.finish_later: Callable[[], None] | None = None

    def timestamp(self, name: str, ns: int) -> None:
        self.events.append((name, ns))

    def compute(self, start: float, end: float, input_ns: int, output_ns: int) -> None:
        """The executor's measurements of the batch this request ran in."""
        start_ns, end_ns = clock_ns(start), clock_ns(end)
        self.events += (
            ("COMPUTE_START", start_ns),
            ("COMPUTE_INPUT_END", start_ns + input_ns),
            ("COMPUTE_OUTPUT_START", end_ns - output_ns),
            ("COMPUTE_END", end_ns),
        )

    def tensor(self, activity: str, name: str, datatype: str, data: np.ndarray) -> None:
        if self.tensors is None:
            return
        self.tensors.append(
            {
                "id": self.id,
                "activity": activity,
                "tensor": {
                    "name": name,
                    "data": _tensor_text(datatype, data),
                    "shape": ",".join(str(d) for d in data.shape),
                    "dtype": datatype,
                },
            }
        )

    def to_json(self) -> str:
        """This trace as Triton writes it: comma-separated objects of a JSON array."""
        head: dict = {
            "id": self.id,
            "model_name": self.model_name,
            "model_version": self.model_version,
        }
        if self.request_id:
            head["request_id"] = self.request_id
        if self.parent_id is not None:
            head["parent_id"] = self.parent_id
        timestamps = "TIMESTAMPS" in self.setting.level
        frontend = self.frontend if timestamps else None
        # Triton's order: an HTTP frontend's RECV pair ahead of the head (written
        # as it samples, before REQUEST_START), the frontend's last ones after
        # REQUEST_END (server src/http_server.cc StartTrace, ReplyCallback;
        # src/grpc/infer_handler.h ClearTraceTimestamps).
        objects = [] if frontend is None else self._stamps(frontend.before)
        objects.append(head)
        if timestamps:
            objects += self._stamps(self.events)
        if frontend is not None:
            objects += self._stamps(frontend.after)
        if self.tensors:
            objects += self.tensors
        return ",".join(json.dumps(o, separators=(",", ":")) for o in objects)

    def _stamps(self, events: list[tuple[str, int]]) -> list[dict]:
        return [{"id": self.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in events]


def _tensor_text(datatype: str, data: np.ndarray) -> str:
    """Tensor data as Triton's TENSORS traces show it: comma-separated elements."""
    flat = data.reshape(-1)
    if datatype == "BYTES":
        items = (
            x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)
            for x in flat.tolist()
        )
        return ",".join(f'"{item}"' for item in items)
    if datatype in ("FP16", "BF16"):
        return ""  # Triton leaves half-precision data out of traces
    if datatype == "BOOL":
        return ",".join("1" if x else "0" for x in flat.tolist())
    if datatype in ("FP32", "FP64"):
        return ",".join(f"{x:g}" for x in flat.tolist())
    return ",".join(str(x) for x in flat.tolist())


def record_compute(
    traces: Mapping[InferenceRequest, Trace],
    requests: Iterable[InferenceRequest],
    start: float,
    end: float,
    input_ns: int,
    output_ns: int,
) -> None:
    """Give the traced requests of one batch the batch's compute timestamps."""
    for request in requests:
        trace = traces.get(request)
        if trace is not None:
            trace.compute(start, end, input_ns, output_ns)


def hold_running(
    traces: Mapping[InferenceRequest, Trace], requests: Iterable[InferenceRequest]
) -> bool:
    """The requests were answered while their model still runs them: their
    traces end once it is done (:func:`settle_compute`), as Triton's REQUEST_END
    comes with the request's release by its backend, after the compute it
    reports (core src/infer_request.cc:475-503). True if any is traced."""
    held = False
    for request in requests:
        trace = traces.get(request)
        if trace is not None:
            trace.running = held = True
    return held


def settle_compute(
    traces: Mapping[InferenceRequest, Trace],
    requests: Iterable[InferenceRequest],
    start: float,
    end: float | None,
) -> None:
    """The model is done with the requests :func:`hold_running` held: their
    traces get the compute from ``start`` to ``end`` (None: it was not seen to
    end, none) and end."""
    for request in requests:
        trace = traces.get(request)
        if trace is None or not trace.running:
            continue
        trace.running = False
        if end is not None:
            trace.compute(start, end, 0, 0)
        finish, trace.finish_later = trace.finish_later, None
        if finish is not None:
            finish()


# -- trace files ------------------------------------------------------------------------


class TraceFile:
    """One trace file name: its index for ``log_frequency`` files, and the main file.

    The main file is opened at its first write (``[`` then traces, ``,`` between
    writes) and closed with ``]`` at shutdown, as Triton does. Its methods run in
    the writer's worker thread in submission order, or on the Trio thread when the
    writer is behind (a chunk written in place): a lock keeps them one at a time.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.next_index = 0  # taken on the Trio thread when a chunk is queued
        self._handle: TextIO | None = None
        self._lock = threading.Lock()

    def write_indexed(self, path: str, text: str) -> None:
        with self._lock, open(path, "w") as f:
            f.write("[" + text + "]")

    def append(self, text: str) -> None:
        with self._lock:
            if self._handle is None:
                self._handle = open(self.name, "w")
                self._handle.write("[" + text)
            else:
                self._handle.write("," + text)
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.write("]")
                self._handle.close()
                self._handle = None


def _run_write(function: Callable[[*_Args], None], args: tuple[*_Args]) -> None:
    try:
        function(*args)
    except OSError as exc:
        log.error("failed writing trace file", error=str(exc))


class TraceFileWriter:
    """The trace files by name, and one task (``run``) that writes chunks to them.

    ``write`` queues a chunk (bounded: when the writer is behind, the chunk is
    written in place, with a warning); the task writes queued chunks in a worker
    thread, in order. ``write`` and ``file`` run on the Trio thread.
    """

    def __init__(self) -> None:
        self._files: dict[str, TraceFile] = {}
        self._send: trio.MemorySendChannel[_Job] | None = None
        self._done = trio.Event()
        self._queued_bytes = 0  # text of the chunks waiting for the writer

    def file(self, name: str) -> TraceFile:
        """The one TraceFile for this name."""
        file = self._files.get(name)
        if file is None:
            file = self._files[name] = TraceFile(name)
        return file

    def write(self, file: TraceFile, text: str, *, indexed: bool) -> None:
        """Write a chunk of traces: to the file's next indexed file, or appended
        to the main file."""
        if indexed and file.next_index >= MAX_TRACE_FILES:
            if file.next_index == MAX_TRACE_FILES:
                log.warning(
                    "trace files: the limit of indexed files is reached; later traces "
                    "are appended to the trace file itself",
                    file=file.name,
                    limit=MAX_TRACE_FILES,
                )
                file.next_index += 1
            indexed = False
        if indexed:
            path = f"{file.name}.{file.next_index}"
            file.next_index += 1
            self._submit(file.write_indexed, path, text, size=len(text))
        else:
            self._submit(file.append, text, size=len(text))

    def _submit(self, function: Callable[[*_Args], None], *args: *_Args, size: int = 0) -> None:
        if self._send is not None:
            if self._queued_bytes + size > MAX_QUEUED_TRACE_BYTES and self._queued_bytes:
                log.warning("trace writer is behind; writing a trace chunk in place")
            else:
                try:
                    self._send.send_nowait((function, args, size))
                    self._queued_bytes += size
                    return
                except trio.WouldBlock:
                    log.warning("trace writer is behind; writing a trace chunk in place")
                except trio.ClosedResourceError:
                    pass
        _run_write(function, args)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write queued chunks in a worker thread until ``aclose``.

        If it is cancelled first, what is queued is written before it ends.
        """
        self._send, receive = trio.open_memory_channel(_WRITE_QUEUE)
        self._done = trio.Event()
        task_status.started()
        job = None
        try:
            async for job in receive:
                # Cancellation can only strike before the thread starts the job
                # (then ``job`` is still set, and is written below).
                await trio.to_thread.run_sync(_run_write, *job[:2])
                self._queued_bytes -= job[2]
                job = None
        finally:
            self._send.close()
            if job is not None:
                _run_write(*job[:2])
            while True:
                try:
                    job = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                _run_write(*job[:2])
            self._queued_bytes = 0
            self._done.set()

    async def aclose(self) -> None:
        """Stop the task once what is queued is written, then close every trace file.

        The files are closed after the task has ended, not through its queue: a close
        written in place while queued chunks wait (the writer behind) would end a file
        that those chunks then reopen and truncate.
        """
        if self._send is not None:
            self._send.close()
            await self._done.wait()
        await trio.to_thread.run_sync(self._close_files)

    def _close_files(self) -> None:
        for file in self._files.values():
            _run_write(file.close, ())
