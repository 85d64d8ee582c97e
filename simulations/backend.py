"""The simulated backend: models whose latency, failures, hangs and crashes follow the
run's fault plan, on the virtual clock.

Registered as ``backend: "sim"``. Its instances echo ``INPUT0`` to ``OUTPUT0``, so
a client can tell its own response from another request's. Two instance kinds
exercise both paths of the executor: ``async`` instances (awaited on the Trio
thread; a crash ends their ``run`` task and with it their executor) and
``thread`` instances (called through ``trio.to_thread.run_sync``, which the
simulation runs inline after the batch's virtual duration, uninterruptibly, as a
real thread would be). Every execution is checked against the version's state
and recorded for the invariant checks.
"""

from __future__ import annotations

import trio

from simulations.faults import Fate
from simulations.probes import CURRENT_VERSION
from simulations.repository import MODEL_FILE, parse_model_file
from simulations.world import Execution, World
from trionserve.actors.model import ModelState
from trionserve.backends.base import Backend
from trionserve.backends.registry import BackendFactory
from trionserve.core.errors import InternalError, TritonError
from trionserve.core.inference import InferenceResponse, Tensor

BACKEND = "sim"
SERVING = "only fully loaded versions serve"


class SimFault(Exception):
    """An injected failure; its message carries the ``[sim]`` marker."""


class SimBackend(Backend):
    name = BACKEND

    def __init__(self, world: World) -> None:
        self.world = world

    def default_model_filename(self) -> str:
        return MODEL_FILE

    def auto_complete_config(self, config, model_path, max_batch_size_set: bool) -> None:
        pass

    def virtual_seconds(self, method: str, args) -> float:
        plan = self.world.setup.faults
        if method == "load":
            rng = self.world.random("load")
            if plan.p_slow_load and rng.random() < plan.p_slow_load:
                return plan.slow_load_seconds
            return plan.duration(rng, plan.load_seconds)
        return 0.0

    def load(self, context) -> SimModel:
        world = self.world
        plan = world.setup.faults
        text = (context.version_dir / MODEL_FILE).read_text()
        if plan.p_load_failure and world.random("load").random() < plan.p_load_failure:
            raise SimFault(f"[sim] injected load failure of '{context.name}'")
        file_generation, complete = parse_model_file(text)
        config_generation = int(context.config.parameters["generation"].string_value)
        state = (context.name, config_generation, context.version, file_generation)
        whole = complete and state in world.complete_states
        return SimModel(world, context, CURRENT_VERSION.get(None), whole, state)


class SimModel:
    """One loaded version; ``whole`` is False when its files were torn or mixed."""

    def __init__(self, world: World, context, version, whole: bool, state) -> None:
        self.world = world
        self.context = context
        self.version = version
        self.whole = whole
        self.state = state
        self.kind = context.config.parameters["sim_kind"].string_value

    def virtual_seconds(self, method: str, args) -> float:
        plan = self.world.setup.faults
        if method == "create_instance":
            return plan.duration(self.world.random("load"), plan.instance_seconds)
        return 0.0

    def create_instance(self, spec):
        kind = AsyncSimInstance if self.kind == "async" else ThreadSimInstance
        return kind(self, spec)

    def unload(self) -> None:
        pass


class _SimInstance:
    def __init__(self, model: SimModel, spec) -> None:
        self.model = model
        self.spec = spec
        self.closed = False
        self._reported = False
        self.label = f"{model.context.name}/{model.context.version}/{spec.name}"

    def close(self) -> None:
        self.closed = True

    def _begin(self, requests) -> Execution:
        """Check that this instance may serve, draw the batch's fate, record it."""
        model, world = self.model, self.model.world
        version = model.version
        if self.closed:
            world.violate(SERVING, f"{self.label} executed a batch after it was closed")
        if not model.whole and not self._reported:
            self._reported = True
            world.violate(
                SERVING,
                f"{self.label} serves files that were not fully written "
                f"(model, config generation, version, file generation: "
                f"{model.state})",
            )
        if version is not None and version.state not in (ModelState.READY, ModelState.UNLOADING):
            world.violate(
                SERVING, f"{self.label} executed while its version was {version.state.value}"
            )
        now = trio.current_time()
        records = [world.record_for(r) for r in requests]
        fate = world.setup.faults.batch_fate(
            world.random("backend"),
            model.context.name,
            len(requests),
            can_crash=isinstance(self, AsyncSimInstance),
            crashes=world.crashes,
        )
        execution = Execution(
            self.label,
            version,
            [r for r in records if r is not None],
            sum(r.batch_size or 1 for r in requests),
            now,
            fate,
        )
        world.executions.append(execution)
        for record in execution.records:
            record.begun_at = now
        return execution

    def _finish(self, execution: Execution, requests) -> list:
        """The batch's results as its fate says; each response is recorded."""
        fate: Fate = execution.fate
        if fate.exception:
            raise SimFault(f"[sim] injected exception in a batch of {self.label}")
        now = trio.current_time()
        context = self.model.context
        results: list[InferenceResponse | TritonError] = []
        for index, request in enumerate(requests):
            record = self.model.world.record_for(request)
            if record is not None:
                record.ended_at = now
            if index in fate.errors:
                results.append(InternalError(f"[sim] injected error for request '{request.id}'"))
                continue
            data = request.inputs["INPUT0"].data.copy()
            response = InferenceResponse(
                context.name,
                str(context.version),
                request.id,
                [Tensor("OUTPUT0", "INT64", data)],
                {"sim_instance": self.label, "sim_state": self.model.state},
            )
            if record is not None:
                record.produced = response
            results.append(response)
        execution.returned = True
        # Requests without a record (a sequence batcher's null requests) are not
        # counted as successes, and alone do not make an execution count.
        execution.responses = sum(
            isinstance(result, InferenceResponse)
            for request, result in zip(requests, results)
            if self.model.world.record_for(request) is not None
        )
        return results


class AsyncSimInstance(_SimInstance):
    """An instance awaited on the Trio thread; ``run`` dies when a batch crashes it."""

    def __init__(self, model: SimModel, spec) -> None:
        super().__init__(model, spec)
        self._crashed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self._crashed.wait()
        raise SimFault(f"[sim] instance {self.label} crashed")

    async def execute_async(self, requests):
        execution = self._begin(requests)
        fate = execution.fate
        if fate.crash:
            self.model.world.crashes += 1
            self._crashed.set()
            await trio.sleep_forever()  # the executor is cancelled when run dies
        await trio.sleep(fate.seconds)  # a hang sleeps until cancelled
        results = self._finish(execution, requests)
        if fate.drop:
            # Deliberately broken: answer all but the first request directly and
            # tell the executor they were answered (the decoupled path).
            for request, result in list(zip(requests, results))[1:]:
                if isinstance(result, InferenceResponse):
                    request.respond(result)
                else:
                    request.fail(result)
            return None
        return results


class ThreadSimInstance(_SimInstance):
    """An instance run through the executor's worker-thread path."""

    def __init__(self, model: SimModel, spec) -> None:
        super().__init__(model, spec)
        self._next: Execution | None = None

    def virtual_seconds(self, method: str, args) -> float:
        """How long ``execute`` takes: the batch starts here (the thread shim asks
        just before the call), so its fate is drawn and recorded now."""
        if method != "execute":
            return 0.0
        self._next = self._begin(args[0])
        fate = self._next.fate
        return self.model.world.setup.faults.thread_hang_seconds if fate.hang else fate.seconds

    def execute(self, requests):
        execution, self._next = self._next, None
        assert execution is not None, "execute called outside the simulation's thread shim"
        return self._finish(execution, requests)


def simulated_backends(world: World) -> dict[str, BackendFactory]:
    """``backend: "sim"`` through ``world``, for the simulated server's ``backends``."""
    return {BACKEND: lambda: SimBackend(world)}
