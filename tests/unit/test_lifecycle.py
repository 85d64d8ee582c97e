"""Server lifecycle in-process: graceful shutdown, containment of backend failures."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import tritonclient.http as httpclient

from tests.blocking_backend import BACKENDS, GATE, make_model, wait_entered
from tests.serverproc import free_port
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.server import Server, ServerOptions


@pytest.fixture
def repository(tmp_path):
    GATE.reset()
    make_model(tmp_path, "blocking")
    yield tmp_path
    GATE.release.set()  # never leave a worker thread blocked


def options(repository, **overrides) -> ServerOptions:
    values = dict(
        model_repositories=[repository],
        http_address="127.0.0.1",
        http_port=free_port(),
        allow_grpc=False,
        allow_metrics=False,
        exit_timeout_secs=20.0,
    )
    values.update(overrides)
    return ServerOptions(**values)


def http_infer(port: int, value: float):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
    try:
        data = np.full((1, 4), value, dtype=np.float32)
        infer_input = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        infer_input.set_data_from_numpy(data)
        return client.infer("blocking", [infer_input]).as_numpy("OUTPUT0")
    finally:
        client.close()


def request(value: float) -> InferenceRequest:
    data = np.full((1, 4), value, dtype=np.float32)
    return InferenceRequest("blocking", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})


async def test_graceful_shutdown_finishes_in_flight_requests(repository):
    server = Server(options(repository), backends=BACKENDS)
    port = server.options.http_port
    results: dict[str, object] = {}

    async def client() -> None:
        results["output"] = await trio.to_thread.run_sync(http_infer, port, 7.0)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        nursery.start_soon(client)
        await wait_entered()  # the request is executing in the backend
        server.shutdown()
        # Let the server act on the shutdown: it drains (HTTP keeps serving) and
        # waits for the in-flight request, which is still blocked in the backend.
        await trio.testing.wait_all_tasks_blocked()
        assert server.dataplane.drain.draining
        assert not server.dataplane.ready()
        assert "output" not in results
        GATE.release.set()
    np.testing.assert_array_equal(results["output"], np.full((1, 4), 7.0, dtype=np.float32))
    assert [row["state"] for row in server.registry.index()] == ["UNAVAILABLE"]


async def test_backend_exception_fails_only_its_batch(repository):
    server = Server(options(repository, allow_http=False), backends=BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        GATE.fail_next = True
        GATE.release.set()
        with pytest.raises(TritonError, match="injected backend failure"):
            await server.dataplane.infer(request(1.0))
        response = await server.dataplane.infer(request(2.0))
        np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 2.0))
        server.shutdown()


async def test_cancelled_request_is_dropped_and_others_answered(repository):
    """A client that goes away while its request is queued is never executed."""
    server = Server(options(repository, allow_http=False), backends=BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        first, second, third = request(1.0), request(2.0), request(3.0)
        answers: dict[str, object] = {}

        async def call(name, req):
            answers[name] = await server.dataplane.infer(req)

        nursery.start_soon(call, "first", first)
        await wait_entered()  # first is executing; the others queue behind it
        with trio.CancelScope() as scope:
            scope.cancel()
            await call("second", second)
        assert second.cancelled
        nursery.start_soon(call, "third", third)
        await trio.testing.wait_all_tasks_blocked()
        GATE.release.set()
        await wait_entered()  # third executes (second was skipped)
        with trio.fail_after(10):
            while "third" not in answers:
                await trio.sleep(0.01)
        assert "second" not in answers
        assert not second.done or second.cancelled
        np.testing.assert_array_equal(answers["third"].outputs[0].data, np.full((1, 4), 3.0))
        server.shutdown()


def _running(function: str) -> bool:
    """Whether a task of this Trio run is inside a coroutine function of that name."""
    tasks = [trio.lowlevel.current_root_task()]
    while tasks:
        task = tasks.pop()
        coro = task.coro
        while coro is not None:
            frame = getattr(coro, "cr_frame", None)
            if frame is not None and frame.f_code.co_name == function:
                return True
            coro = getattr(coro, "cr_await", None)
        for nursery in task.child_nurseries:
            tasks.extend(nursery.child_tasks)
    return False


async def test_unload_answers_queued_requests(repository, autojump_clock):
    """Past the drain deadline, queued requests get an error, not silence.

    Virtual time: the 0.2 s drain deadline passes as soon as every task is blocked.
    """
    server = Server(
        options(
            repository, allow_http=False, exit_timeout_secs=0.2, model_control_mode=ControlMode.NONE
        ),
        backends=BACKENDS,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        outcomes: list[str] = []

        async def call(value):
            try:
                await server.dataplane.infer(request(value))
                outcomes.append((value, "ok"))
            except TritonError as exc:
                outcomes.append((value, exc.status.value))

        async with trio.open_nursery() as clients:
            clients.start_soon(call, 1.0)
            await wait_entered()
            clients.start_soon(call, 2.0)
            await trio.testing.wait_all_tasks_blocked()
            clients.start_soon(server.registry.unload, "blocking")
            # The model's drain deadline passes with one request executing, one
            # queued, and the model gives up on them: its executor stops taking
            # batches. (The test shut the whole server down before and slept a
            # fixed virtual second: with the drain's deadline spent, the server's
            # unload had no time left, so whether the model was told to unload
            # before the gate opened depended on the threads' timing.)
            with trio.fail_after(5):
                while _running("_feed"):
                    await trio.sleep(0.05)
            assert outcomes == []
            GATE.release.set()
        server.shutdown()
        # The executing request's result was produced, so it is delivered; the
        # queued one never ran and is answered with an error.
        assert sorted(outcomes) == [(1.0, "ok"), (2.0, "UNAVAILABLE")]


async def test_shutdown_unloads_ensembles_before_their_composing_models():
    """An ensemble's in-flight requests still need its steps' models at shutdown."""
    from tests.serverproc import EXAMPLES

    server = Server(options(EXAMPLES, allow_http=False), backends=BACKENDS)
    order: list[str] = []
    unload = server.registry.unload

    async def recording_unload(name, **kwargs):
        order.append(name)
        await unload(name, **kwargs)

    server.registry.unload = recording_unload
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        server.shutdown()
    assert order.index("simple_ensemble") < order.index("simple")
    assert set(order) >= {"simple", "simple_ensemble", "identity_fp32"}
