"""The real gRPC frontend on a loopback port, driven by tritonclient.grpc in worker
threads: the same plan as ``http_frontend_faults`` (backend exceptions and latency,
clients that give up mid-request with a gRPC deadline, a shutdown midway). Real
sockets and threads: this scenario runs on the real clock with bounded waits, so a
seed fixes its plan, not its exact timing."""

from __future__ import annotations

import numpy as np
import trio

from simulations.clients import phase_of
from simulations.scenario import scenario
from simulations.scenarios.http_frontend import (
    WAIT,
    check_wire,
    drive_frontend,
    frontend_setup,
)
from simulations.world import RequestRecord
from trionserve.core.errors import Unavailable
from trionserve.protocol.grpc.service import serve_grpc


def _call(port: int, record: RequestRecord) -> tuple:
    """One blocking tritonclient call, in a worker thread; the wire outcome."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    values = np.arange(record.batch_size, dtype=np.int64).reshape(-1, 1) + record.number * 1000
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "INT64")
    tensor.set_data_from_numpy(values)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        result = client.infer(
            record.model,
            [tensor],
            request_id=f"r{record.number}",
            client_timeout=record.cancel_after or WAIT,
        )
        return ("response", result.as_numpy("OUTPUT0").tolist())
    except InferenceServerException as exc:
        status = str(exc.status())
        if "DEADLINE_EXCEEDED" in status:
            return ("disconnected",) if record.cancel_after else ("timeout",)
        if "UNAVAILABLE" in status and record.client is None:
            return ("closed", exc.message())  # no listener, or the connection dropped
        return ("error", status, exc.message())
    finally:
        client.close()


async def _client(world, port: int, record: RequestRecord) -> None:
    record.tags["wire"] = await trio.to_thread.run_sync(_call, port, record)
    record.finished_at = trio.current_time()
    if record.client is not None:  # the DataPlane answered before the client went
        return
    if record.tags["wire"] == ("disconnected",):
        record.client, record.cancel_phase = "cancelled", phase_of(record)
    else:  # the request never reached the DataPlane
        record.client = "error"
        record.client_value = Unavailable(f"no answer on the wire: {record.tags['wire']}")


@scenario(
    "grpc_frontend_faults",
    "requests through the real gRPC frontend (tritonclient in threads, loopback "
    "sockets) while the backend raises and lags, clients give up mid-request and the "
    "server shuts down midway: one outcome per answered request, nothing lost, no task "
    "left",
    setup=frontend_setup,
    checks=(check_wire,),
    fast_seeds=2,
    real_time=True,
)
async def grpc_frontend_faults(world) -> None:
    await drive_frontend(world, serve_grpc, _client)
