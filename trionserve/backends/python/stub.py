"""The stub process: runs one instance of a Python model (``model.py``) for the server.

Started by the server with one end of a Unix socket (see :mod:`.process`). The
first message says what to do: ``auto_complete`` (call the model class's static
``auto_complete_config`` and exit) or ``initialize`` (load the model, call
``initialize(args)``, then serve).

Threads while serving: the main thread runs the model's ``execute`` and
``finalize``, one call at a time. An execute and its reply travel on the lane
(:mod:`.lane`: slots in shared memory and a doorbell each way), so a request
costs the main thread no socket message; the main thread takes the next execute
from the lane as soon as it replied (the server posts one behind the one that
runs) and blocks on its doorbell only when none is there. A reader thread reads
everything else the server sends on the socket (cancellations, BLS responses,
metric and control replies, finalize, and an execute too large for the lane,
after which it rings the main thread's doorbell). A watcher thread
ends the process as soon as the server goes away (even while ``execute`` runs);
the model's own threads may send responses at any time; an asyncio loop thread
runs ``async def execute`` coroutines; a last thread ends the requests whose
response senders the model released without their final response (so every
request is answered).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from trionserve.backends.python.lane import Lane, encode
from trionserve.backends.python.runtime import ModelRuntime, describe_exception
from trionserve.backends.python.shm import Arena, ArenaView, block_of
from trionserve.backends.python.wire import BlockingChannel, Endpoint
from trionserve.core.memory import release_free_memory

if TYPE_CHECKING:
    from trionserve.backends.python.messages import EncodedResponse
    from trionserve.backends.python.stubpath import triton_python_backend_utils as pb_utils

STUBPATH = Path(__file__).resolve().parent / "stubpath"
# A response sender waits while the responses its stub sent and the server has
# not read yet hold this many bytes of shared memory (at least one always goes):
# a model that produces faster than the server takes does not grow the stub.
STUB_BACKLOG_BYTES = 8 * 1024 * 1024


def import_model(message: dict[str, Any]) -> ModuleType:
    """Import model.py as Triton's stub does: ``<version>.model``, with the model
    directory (and the version directory) on the import path."""
    model_file = Path(message["model_file"])
    version_dir = model_file.parent
    sys.path.insert(0, str(STUBPATH))
    sys.path.append(str(version_dir))
    sys.path.append(str(version_dir.parent))
    return importlib.import_module(f"{version_dir.name}.{model_file.stem}")


class _BLSCall:
    """A BLS request in flight: its responses arrive from the reader thread."""

    def __init__(self, runtime: StubRuntime, call_id: int) -> None:
        self.runtime = runtime
        self.id = call_id
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False
        self._first: tuple | None = None

    def wait_first(self) -> None:
        """Block until the first response is here, as Triton's ``exec(decoupled=
        True)`` does: ``async_exec`` then waits in its executor thread, not in the
        event loop when the model iterates."""
        self._first = self.responses.get()

    def next_response(self) -> pb_utils.InferenceResponse:
        if self.finished:
            raise StopIteration
        if self._first is not None:
            (response, final), self._first = self._first, None
        else:
            response, final = self.responses.get()
        if final:
            self.finished = True
            if response is None:
                response = self.runtime.pb.InferenceResponse([])
        return response

    def cancel(self) -> None:
        if not self.finished:
            self.runtime.channel.send({"op": "bls_cancel", "call": self.id})


class StubRuntime(ModelRuntime):
    """The model instance and everything the stub does on its behalf."""

    def __init__(self, channel: BlockingChannel, message: dict, lane: Lane) -> None:
        self.channel = channel
        self._lane = lane
        # Signalled by the reader thread after each message it handled, while the
        # main thread waits for it to catch up with an execute from the lane.
        self._arrived = threading.Condition()
        self.arena = channel.endpoint.arena
        self.view = channel.endpoint.view
        self.instance_name: str = message["instance"]
        self.model_name: str = message["model_name"]
        self.decoupled: bool = message["decoupled"]
        # pb_utils.get_model_dir(): the model's version directory, also for a
        # Python-based backend whose model.py lives elsewhere (pb_stub.cc
        # ModelContext::Init: the directory of <repository>/<version>/model.py).
        self.model_dir: str = message["model_dir"]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, _BLSCall] = {}
        self._call_ids = itertools.count(1)
        self._waits: dict[int, queue.SimpleQueue] = {}
        self._cancelled: set[int] = set()
        # Requests the model still has to answer through their response senders;
        # a sender released while its request is here ends up in ``_released``.
        self._unanswered: set[int] = set()
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = None  # an asyncio loop, started for the first coroutine
        self._serving = False
        self._finalizing = False
        # A process the model forks (multiprocessing's default on Linux) shares
        # the stub's connection but none of its threads: it must not use it.
        self._forked = False
        os.register_at_fork(after_in_child=self._after_fork)
        # Whoever reads the socket holds ``_reading``: the main thread between
        # calls, a poll from is_cancelled(), or the reader thread once started.
        self._reading = threading.Lock()
        self._reader_started = False
        self._reader_lock = threading.Lock()
        self._main_thread = threading.get_ident()
        # Clear while the server's budget of bytes held for clients is full: a
        # response sender waits for room (or its request's cancellation). The
        # server numbers its notices; the latest wins.
        self._budget_room = threading.Event()
        self._budget_room.set()
        self._budget_notice = 0
        self._send_gate = threading.Lock()
        self._trimmed = 0.0  # when memory was last given back (monotonic)
        module = import_model(message)
        import triton_python_backend_utils as pb

        self.pb = pb
        pb._runtime = self
        self.model = module.TritonPythonModel()

    # -- main thread ------------------------------------------------------------------

    def serve(self, args: dict) -> None:
        initialize = getattr(self.model, "initialize", None)
        try:
            if initialize is not None:
                initialize(args)
        except BaseException as exc:
            self.channel.send({"op": "error", "message": describe_exception(exc)})
            return
        self._serving = True
        threading.Thread(target=self._answer_released, name="stub-released", daemon=True).start()
        threading.Thread(target=self._watch_server, name="stub-watcher", daemon=True).start()
        # The reader reads the socket from now on: executes come on the lane. A
        # model with is_ready() is asked while it executes too (pb_stub.cc runs
        # the check on its parent-to-stub monitor thread).
        self._start_reader()
        self.channel.send({"op": "initialized", "is_ready": hasattr(self.model, "is_ready")})
        while True:
            job = self._next_job()
            if isinstance(job, tuple):  # from the lane
                call_id, sent, freed, entries = job
                self._catch_up(sent)
                if freed:
                    self.arena.free(freed)
                self._execute(call_id, entries)
            elif job["op"] == "finalize":
                self._finalize()
                return
            else:  # an execute that came on the socket
                self._execute(job["id"], job["requests"])

    def _next_job(self) -> tuple | dict:
        """The next execute (from the lane, or queued by the reader) or finalize;
        blocks on the doorbell until one is there."""
        lane, jobs = self._lane, self._jobs
        while True:
            message = lane.take()
            if message is not None:
                return message
            if not jobs.empty():  # (no exception raised per call: c=1 waits each time)
                return jobs.get_nowait()
            lane.wait_blocking()

    def _catch_up(self, sent: int) -> None:
        """Wait until the reader has handled the ``sent`` messages the server sent
        on the socket before this execute (a segment it refers to, a cancel)."""
        endpoint = self.channel.endpoint
        if endpoint.received >= sent:
            return
        with self._arrived:
            self._arrived.wait_for(lambda: endpoint.received >= sent)

    def _watch_server(self) -> None:
        """End the process once the server closed its end of the socket, even
        while the main thread is busy in ``execute`` (it is woken by nothing else)."""
        watcher = select.poll()
        watcher.register(self.channel.sock.fileno(), getattr(select, "POLLRDHUP", 0))
        while True:
            for _, events in watcher.poll():
                if events & (getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR):
                    os._exit(0)

    def _start_reader(self) -> None:
        """From now on the reader thread reads (and queues the jobs): something
        waits for the server while the main thread may be busy."""
        if self._reader_started:
            return
        with self._reader_lock:
            if self._reader_started:
                return
            self._reader_started = True
            threading.Thread(target=self._read, name="stub-reader", daemon=True).start()

    def _finalize(self) -> None:
        self._finalizing = True
        finalize = getattr(self.model, "finalize", None)
        error = None
        try:
            if finalize is not None:
                finalize()
        except BaseException as exc:
            error = describe_exception(exc)
        self.channel.send({"op": "finalized", "error": error})

    def _execute(self, call_id: int, entries: list) -> None:
        pb = self.pb
        requests = [self._incoming(entry) for entry in entries]
        responses = None
        error = None
        rescheduled: list[int] = []
        try:
            result = self.call_execute(requests)
            if result is not None:
                responses = self._encode_all(requests, result)
                for request, encoded in zip(requests, responses):
                    if encoded is not None:
                        request.get_response_sender()._close()
                        self._unanswered.discard(request._key)
            # None: each request is answered through its response sender, now or
            # later, from any thread (Triton allows it for every model).
            for request in requests:
                if request._release_flags & pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                    # Back to the server's queue: this execution's sender is done,
                    # the next execution gets its own (python_be.cc releases the
                    # request with the flag once execute returned).
                    request.get_response_sender()._close()
                    self._unanswered.discard(request._key)
                    rescheduled.append(request._key)
        except BaseException as exc:
            error = self.execute_error(exc)
            rescheduled = []  # python_be.cc: flags back to RELEASE_ALL
            # As Triton: the requests end with the error, their senders close.
            for request in requests:
                request.get_response_sender()._close()
                self._unanswered.discard(request._key)
        self._reply(call_id, error, rescheduled, responses)

    def _reply(
        self,
        call_id: int,
        error: str | None,
        rescheduled: list[int],
        responses: list[EncodedResponse | None] | None,
    ) -> None:
        """The execute's outcome, all its responses in one message: on the lane,
        unless it refers to a segment not announced yet or does not fit there;
        then on the socket, with the doorbell rung all the same (the server waits
        on it)."""
        endpoint = self.channel.endpoint
        sent = self.channel.sent_if_announced()
        if sent is not None:
            freed = endpoint.take_released()
            body = encode((call_id, sent, freed, error, rescheduled, responses))
            if self._lane.post(body):
                return
            endpoint.release(freed)  # they go with the socket message instead
        self.channel.send(
            {
                "op": "executed",
                "id": call_id,
                "error": error,
                "rescheduled": rescheduled,
                "responses": responses,
            }
        )
        self._lane.ring()

    def _incoming(self, entry: tuple[Any, ...]) -> pb_utils.InferenceRequest:
        """A request of an execute, as :func:`.messages.request_message` wrote it."""
        pb = self.pb
        key, request_id, correlation_id, flags, parameters, refs, outputs, cancelled, trace = entry
        view_array = self.view.array
        wrap = pb.Tensor._wrap
        inputs = [wrap(ref[0], ref[1], view_array(ref, copy=False)) for ref in refs]
        request = pb.InferenceRequest._received(
            key,
            request_id,
            correlation_id,
            inputs,
            outputs,
            self.model_name,
            flags,
            parameters,
            pb.InferenceResponseSender(key, self.decoupled),
            None if trace is None else pb.InferenceTrace(key, trace),
        )
        self._unanswered.add(key)
        if cancelled:
            self._cancelled.add(key)
        return request

    def sender_released(self, key: int) -> None:
        """A request's sender is gone (garbage, ``InferenceResponseSender.__del__``):
        nothing can answer it any more. Runs wherever the collector runs, so it
        only queues."""
        self._cancelled.discard(key)
        if key in self._unanswered:
            self._released.put(key)

    def _answer_released(self) -> None:
        """End the requests whose senders the model let go without their final
        response, so that their clients are answered (a thread of its own)."""
        while True:
            key = self._released.get()
            if key in self._unanswered:
                error = self.pb.TritonError(
                    "the model released the request without sending its final response "
                    "(a response returned from execute, or one sent with "
                    "TRITONSERVER_RESPONSE_COMPLETE_FINAL)"
                )
                self.send_response(key, self.pb.InferenceResponse(error=error), True)

    def _encode_all(
        self,
        requests: Sequence[pb_utils.InferenceRequest],
        result: list[pb_utils.InferenceResponse | None],
    ) -> list[EncodedResponse | None]:
        """The returned responses as messages; None where the model answers (or
        answered) the request through its response sender."""
        self.check_returned(requests, result)
        encoded: list[EncodedResponse | None] = []
        try:
            for response in result:
                encoded.append(None if response is None else self.encode_response(response))
        except BaseException:
            # Nothing is sent: the blocks already written go back to the arena.
            blocks = (block_of(ref) for e in encoded if e is not None for ref in e[0])
            self.arena.free(block for block in blocks if block is not None)
            raise
        return encoded

    def encode_response(self, response: pb_utils.InferenceResponse) -> EncodedResponse:
        """A response as ``(tensor references, error, parameters)``
        (:data:`.messages.EncodedResponse`); its tensors are written to shared
        memory."""
        error = response.error()
        if error is not None:
            return ([], (error.code(), error.message()), "{}")
        write = self.arena.write
        refs = [
            write(tensor.name(), tensor._datatype, tensor._host_array())[0]
            for tensor in response.output_tensors()
        ]
        return (refs, None, response.parameters())

    # -- called from pb_utils, on any thread ------------------------------------------

    def _after_fork(self) -> None:
        self._forked = True

    def _check_not_forked(self, what: str) -> None:
        """In a forked child, calls to the server fail at once instead of waiting
        forever for an answer that goes to the stub process. Triton's stub shares
        its message queues with such children through shared memory; this one
        talks to the server over a connection that only its own threads read."""
        if self._forked:
            raise self.pb.TritonModelException(
                f"{what} is not available in a process forked from the stub process "
                "by trionserve; use threads, or make the calls from the stub process"
            )

    def send_response(
        self, key: int, response: pb_utils.InferenceResponse | None, final: bool
    ) -> None:
        self._check_not_forked("sending a response")
        # What the server sent meanwhile is read first: the blocks it freed go
        # back to the arena, so a model streaming from execute (which no thread
        # reads during) reuses its shared memory instead of growing it.
        self._poll()
        if final:
            self._unanswered.discard(key)
        if response is None:
            encoded = None
        else:
            # One sender at a time checks for room and writes its response: the
            # senders of several requests do not all pass the check at once.
            with self._send_gate:
                room = True
                if not self._budget_room.is_set() or self.arena.in_use() >= STUB_BACKLOG_BYTES:
                    room = self._wait_for_room(key)
                # A response whose wait for room its request's cancellation ended is
                # not written (its client is gone). A cancelled request's responses
                # sent without waiting still go: the server delivers them, as a
                # model's CANCELLED error after is_cancelled() (a BLS caller's
                # ResponseIterator.cancel() gets it).
                encoded = self.encode_response(response) if room else None
        self.channel.send({"op": "response", "key": key, "response": encoded, "final": final})

    def _wait_for_room(self, key: int) -> bool:
        """Wait (this model thread) until the responses sent and not yet read by
        the server (its blocks not freed) are under ``STUB_BACKLOG_BYTES`` and
        the server's budget of bytes held for clients has room, or until the
        request is cancelled (its client gone, or evicted by the server's
        pressure policy): whether there is room (False: cancelled first). The reader
        thread reads the server's frees and notices meanwhile."""
        self._start_reader()
        arena = self.arena
        while not arena.wait_freed(STUB_BACKLOG_BYTES, 0.05):
            if key in self._cancelled:
                return False
        while not self._budget_room.wait(0.05):
            if key in self._cancelled:
                return False
        return True

    def is_cancelled(self, key: int) -> bool:
        """Whether the server said the request is cancelled; reads what the server
        sent meanwhile, without waiting, unless another thread is reading."""
        self._poll()
        return key in self._cancelled

    def _poll(self) -> None:
        """Dispatch the messages the server sent, without waiting; nothing to do
        when another thread is reading (it dispatches them as they come)."""
        if self._serving and not self._reader_started and self._reading.acquire(blocking=False):
            try:
                messages = self.channel.poll()
                if messages is None:
                    os._exit(0)  # the server went away
                for message in messages:
                    self._dispatch(message)
            finally:
                self._reading.release()

    def log(self, level: str, message: str) -> None:
        if self._forked:
            print(f"[{level}] {message}", file=sys.stderr, flush=True)
            return
        self.channel.send({"op": "log", "level": level, "message": message})

    def metric(self, action: str, fields: dict[str, Any]) -> Any:
        """A custom-metric operation; the server's answer, or its error raised."""
        return self._ask({"op": "metric", "action": action, **fields})

    def control(self, action: str, fields: dict[str, Any]) -> Any:
        """A model loading API call; the server's answer, or its error raised."""
        return self._ask({"op": "control", "action": action, **fields})

    def _ask(self, message: dict[str, Any]) -> Any:
        """Send ``message`` and wait for the server's reply to it.

        The main thread reads until the reply is here, dispatching anything else
        (before serving, and from ``execute`` while it reads); any other thread
        leaves reading to the reader thread, started if need be.
        """
        self._check_not_forked(f"pb_utils {message['op']} calls")
        call = next(self._call_ids)
        message["call"] = call
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        self._waits[call] = waiter
        self.channel.send(message)
        if threading.get_ident() != self._main_thread:
            self._start_reader()
        while waiter.empty() and not self._reader_started:
            with self._reading:
                if not waiter.empty() or self._reader_started:
                    break
                received = self.channel.receive()
                if received is None:
                    os._exit(0)  # the server went away
                self._dispatch(received)
        reply = waiter.get()
        if reply["error"] is not None:
            raise self.pb.TritonModelException(reply["error"])
        return reply["result"]

    def metric_release(self, action: str, fields: dict) -> None:
        """A family or metric object was deleted; no answer is awaited."""
        try:
            self.channel.send({"op": "metric", "action": action, "call": None, **fields})
        except OSError:
            pass  # the server is gone, and its references with it

    def bls(
        self, request: pb_utils.InferenceRequest, decoupled: bool
    ) -> pb_utils.InferenceResponse | pb_utils.ResponseIterator:
        self._check_not_forked("BLS")
        if not self._serving or self._finalizing:
            # python_backend's words (infer_request.cc InferRequest::Exec).
            raise self.pb.TritonModelException(
                "BLS is only supported during the 'execute' function."
            )
        self._start_reader()  # the reply must be read while this thread waits
        call = _BLSCall(self, next(self._call_ids))
        refs = [
            self.arena.write(t.name(), t._datatype, t._host_array())[0] for t in request.inputs()
        ]
        self._calls[call.id] = call
        self.channel.send(
            {
                "op": "bls",
                "call": call.id,
                "decoupled": decoupled,
                "model_name": request.model_name(),
                "model_version": request.model_version(),
                "id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
                "timeout": request.timeout(),
                "parameters": request.parameters(),
                "inputs": refs,
                "outputs": list(request.requested_output_names()),
                # The received request whose trace this one is a child of, if any.
                "trace": request.trace()._key,
            }
        )
        if decoupled:
            call.wait_first()
            return self.pb.ResponseIterator(call)
        return call.next_response()

    # -- reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        arrived = self._arrived
        while True:
            with self._reading:
                message = self.channel.receive()
            if message is None:
                # The server went away: nothing is left to serve.
                os._exit(0)
            self._dispatch(message)
            with arrived:
                arrived.notify_all()

    def _dispatch(self, message: dict) -> None:
        op = message["op"]
        if op in ("execute", "finalize"):
            self._jobs.put(message)
            self._lane.ring_self()
        elif op == "bls_response":
            self._bls_response(message)
        elif op in ("metric_reply", "control_reply"):
            waiter = self._waits.pop(message["call"], None)
            if waiter is not None:
                waiter.put(message)
        elif op == "cancel":
            self._cancelled.update(message["keys"])
        elif op == "budget":
            if message["notice"] > self._budget_notice:
                self._budget_notice = message["notice"]
                if message["full"]:
                    self._budget_room.clear()
                else:
                    self._budget_room.set()
                    # A burst ended: what it freed goes back to the system, at
                    # most once a second.
                    now = time.monotonic()
                    if now - self._trimmed >= 1.0:
                        self._trimmed = now
                        release_free_memory()
        elif op == "is_ready":
            threading.Thread(
                target=self._is_ready, args=(message["id"],), name="stub-is-ready", daemon=True
            ).start()

    def _is_ready(self, check: int) -> None:
        """Run the model's ``is_ready()`` and send what it said (pb_stub.cc
        ProcessUserModelReadinessRequest: a coroutine is run to its end, anything
        but a bool is an error, an exception means not ready)."""
        reply: dict = {"op": "ready_state", "id": check, "ready": False, "error": None}
        try:
            result = self.model.is_ready()
            if inspect.iscoroutine(result):
                result = self._run_coroutine(result).result()
            if not isinstance(result, bool):
                raise TypeError("is_ready() must return a boolean value")
            reply["ready"] = result
        except BaseException as exc:
            reply["error"] = describe_exception(exc)
        self.channel.send(reply)

    def _bls_response(self, message: dict) -> None:
        pb = self.pb
        call = self._calls.get(message["call"])
        encoded = message["response"]
        response = None
        if encoded is not None:
            refs, sent_error, parameters = encoded
            tensors = []
            for ref in refs:
                array = self.view.array(ref, copy=True)
                tensors.append(pb.Tensor._wrap(ref[0], ref[1], array))
            self.channel.endpoint.release(block_of(ref) for ref in refs)
            error = None
            if sent_error is not None:
                code, text = sent_error
                error = pb.TritonError(text, code)
            response = pb.InferenceResponse(tensors, error)
            response._parameters = parameters
        if self.channel.endpoint.should_flush():
            self.channel.flush_releases()
        if message["final"]:
            self._calls.pop(message["call"], None)
        if call is not None:
            call.responses.put((response, message["final"]))


def _auto_complete(channel: BlockingChannel, message: dict) -> None:
    try:
        module = import_model(message)
        import triton_python_backend_utils as pb

        config = pb.ModelConfig(message["config"])
        model_class = module.TritonPythonModel
        if hasattr(model_class, "auto_complete_config"):
            config = model_class.auto_complete_config(config)
            if not isinstance(config, pb.ModelConfig):
                raise TypeError(
                    f"auto_complete_config function in model '{message['model_name']}' "
                    "must return a valid pb.ModelConfig object."
                )
        channel.send({"op": "auto_completed", "config": json.dumps(config.as_dict())})
    except BaseException as exc:
        channel.send({"op": "error", "message": describe_exception(exc)})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    # The server decides when a stub ends; a terminal's Ctrl+C is for the server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # argv: -c, the process's name, the socket, the arena sizes, the lane's
    # descriptors, the stub's name.
    sock = socket.socket(fileno=int(argv[2]))
    default_size, growth_size = int(argv[3]), int(argv[4])
    lane = Lane.open(argv[5])
    # The model sees the argv of python_backend's stub: an interpreter embedded
    # with no arguments (pb_stub.cc main, ``py::scoped_interpreter guard{}``), whose
    # sys.argv is [''], so unittest.main() in a model.py parses no stub arguments.
    sys.argv[:] = [""]
    arena = Arena(default_size, growth_size)
    channel = BlockingChannel(sock, Endpoint(arena, ArenaView(), default_size // 4))
    message = channel.receive()
    if message is None:
        return
    if message["op"] == "auto_complete":
        _auto_complete(channel, message)
        return
    try:
        runtime = StubRuntime(channel, message, lane)
    except BaseException as exc:
        channel.send({"op": "error", "message": describe_exception(exc)})
        return
    runtime.serve(message["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    # Threads the model started must not keep a finalized stub alive.
    os._exit(0)


if __name__ == "__main__":
    main()
