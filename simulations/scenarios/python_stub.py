"""A Python-backend stub process killed with SIGKILL mid-execution, or hung past its
``execute-timeout-seconds``, through the real restart path. Real processes: this
scenario runs on the real clock with bounded waits, so a seed fixes its plan
(requests, kill moments), not its exact timing."""

from __future__ import annotations

import os
import signal
import textwrap

import trio

from simulations.clients import infer, spawn, wait_for
from simulations.scenario import Setup, scenario

RESTARTS = "a killed stub process is restarted and serves again"

CONFIG = """
name: "stub"
backend: "python"
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT0" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
parameters {{ key: "execute-timeout-seconds" value {{ string_value: "1" }} }}
{batching}
"""

# Echoes INPUT0 (so a client can tell its response), reports the stub's pid, and
# takes 20-60 ms per request, so that a kill lands while requests execute; a
# request of batch size 3 hangs (until execute-timeout-seconds kills the stub).
MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if values.shape[0] == 3:
                time.sleep(3600)
            time.sleep(0.02 + (int(values.ravel()[0]) // 1000 % 5) * 0.01)
            pid = np.full(values.shape, os.getpid(), dtype=np.int64)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", values.copy()), pb_utils.Tensor("PID", pid)]
            ))
        return responses
"""


def _setup(world) -> Setup:
    rng = world.random("setup")
    batching = (
        "dynamic_batching { max_queue_delay_microseconds: 2000 }" if rng.random() < 0.5 else ""
    )
    config = CONFIG.format(instances=rng.randint(1, 2), batching=batching)
    return Setup(
        [],
        files={"stub/config.pbtxt": config, "stub/1/model.py": textwrap.dedent(MODEL)},
        exit_timeout=10.0,
        shutdown_limit=15.0,
        tolerate_repeated_errors=True,
        backend_errors=("the stub process",),
        observes_executions=False,
        hang_limit=20.0,
        run_limit=120.0,
    )


def _pids(world) -> list[int]:
    return [
        int(r.client_value.outputs[1].data.ravel()[0])
        for r in world.records
        if r.client == "response"
    ]


@scenario(
    "python_stub_kill",
    "SIGKILL a Python model's stub process while it executes, or hang it past "
    "execute-timeout-seconds (real processes, real clock): its requests fail, the "
    "stub restarts, the model keeps serving",
    setup=_setup,
    fast_seeds=2,
    real_time=True,
)
async def python_stub_kill(world) -> None:
    rng = world.random("script")
    for _ in range(rng.randint(1, 2)):
        hang = rng.random() < 0.3
        for _ in range(rng.randint(6, 12)):
            spawn(world, "stub", batch=rng.randint(1, 2))
            await trio.sleep(rng.uniform(0.0, 0.02))
        if hang:
            spawn(world, "stub", batch=3)
        else:
            await trio.sleep(rng.uniform(0.0, 0.05))
            if not await wait_for(lambda: _pids(world), limit=20.0):
                world.violate(RESTARTS, "no request succeeded before the kill")
                return
            os.kill(_pids(world)[-1], signal.SIGKILL)
        what = "hangs" if hang else "kills"
        world.notes[what] = world.notes.get(what, 0) + 1
        await wait_for(lambda: all(r.client for r in world.records), limit=20.0)
    world.notes["failed_by_stub"] = sum(
        r.client == "error" and "the stub process" in r.client_value.message for r in world.records
    )
    with trio.move_on_after(30.0):
        record = await infer(world, "stub")
        if record.client != "response":
            world.violate(RESTARTS, f"after the kill: {record.client_value!r}")
