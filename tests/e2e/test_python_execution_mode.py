"""The Python-backend parity tests in every execution mode (issue 30, item 1).

One real server per mode, ``EXECUTION_MODE`` ``stub`` (the default: a stub process
per instance), ``in_process`` (model.py on the server's threads) and
``event_loop`` (``in_process`` with ``INPROCESS_EXECUTE_ON`` ``event_loop``:
execute on the event loop's thread; the models that call other models keep
their thread there, as that mode asks), serving the same model.py files: BLS (sync, async, decoupled, cancelled, names as bytes),
decoupled models and response senders, a client's cancellation reaching the
model, execute errors and Triton's wording, custom metrics and log lines, the
model's ``is_ready()``, request rescheduling, refused configurations. The
tests are those of the Python-backend e2e modules, collected here again with this
module's ``server``; what only the in-process mode promises (one module namespace
per model, no stub process, the refused configurations) and what only the
``event_loop`` mode promises (where execute runs, the budget, the calls it
refuses instead of waiting for the loop it blocks) are tested below them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from tests.e2e import test_python_backend as base
from tests.e2e import test_python_backend_parity as parity
from tests.e2e import test_python_backend_qa as qa
from tests.e2e import test_python_custom_metrics as metrics

# The tests of the Python-backend e2e modules that run here, in both modes.
from tests.e2e.test_python_backend import (  # noqa: F401
    test_add_sub,
    test_auto_complete_config_fills_the_config,
    test_bls_calls_onnx_and_python_models,
    test_bls_error_is_a_response_error,
    test_bls_over_a_decoupled_model,
    test_decoupled_model_streams_over_grpc,
    test_execute_raising_fails_the_request_only,
    test_initialize_args_and_request_fields,
    test_response_sender_in_a_model_that_is_not_decoupled,
    test_triton_error_in_a_response_reaches_the_client,
)
from tests.e2e.test_python_backend_parity import (  # noqa: F401
    Stream,
    test_a_client_cancel_reaches_a_model_that_has_not_responded,
    test_a_final_flag_without_a_response_fails_the_request,
    test_a_second_response_is_refused_and_the_first_stands,
    test_an_exception_after_the_final_response_is_logged,
    test_async_exec_of_decoupled_calls_overlap,
    test_bls_takes_the_model_name_as_bytes,
    test_one_response_sent_later_from_another_thread,
    test_response_iterator_cancel_cancels_the_called_request,
    test_sender_rules_over_a_grpc_stream,
    test_the_empty_final_response_always_reaches_the_iterator,
)
from tests.e2e.test_python_backend_qa import (  # noqa: F401
    grpc_client,
    test_a_rescheduled_request_must_return_none,
    test_a_rescheduled_request_of_a_model_that_is_not_decoupled,
    test_an_iterative_sequence_executes_a_rescheduled_request_again,
    test_is_ready_of_the_model_is_consulted,
    test_rescheduling_without_an_iterative_sequence_is_refused,
)
from tests.e2e.test_python_custom_metrics import (  # noqa: F401
    test_counter_gauge_and_histogram_reach_the_metrics_endpoint,
    test_the_rules_hold_inside_the_model,
)
from tests.repository import python_model
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.python.settings import StubSettings
from trionserve.core.errors import InvalidArgument

MODES = ["stub", "in_process", "event_loop"]

# Two models that write the same module globals: each must see only its own.
GLOBALS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

from helper import WHO  # a plain import of a file beside model.py, as a stub allows


class TritonPythonModel:
    def initialize(self, args):
        self.seen_before = getattr(pb_utils, "WRITTEN_BY", "")
        pb_utils.WRITTEN_BY = args["model_name"]
        # Tensor comes from a sibling module of pb_utils: that one is the model's own too.
        self.tensor_seen_before = getattr(pb_utils.Tensor, "WRITTEN_BY", "")
        pb_utils.Tensor.WRITTEN_BY = args["model_name"]

    def execute(self, requests):
        import c_python_backend_utils as c_late  # imports inside a function
        import triton_python_backend_utils as late

        free = c_late.shared_memory.free_memory()  # no arena in-process: 0
        text = f"{self.seen_before}|{pb_utils.WRITTEN_BY}|{late.WRITTEN_BY}|{WHO}|{type(free).__name__}"
        text += f"|{self.tensor_seen_before}|{late.Tensor.WRITTEN_BY}"
        out = np.array([text.encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]) for _ in requests]
"""
GLOBALS_CONFIG = """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


BAD_CONFIGS = {
    "bad_mode": ('parameters { key: "EXECUTION_MODE" value: { string_value: "threads" } }\n'),
    "env_in_process": (
        'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
        'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "env.tar.gz" } }\n'
    ),
}


def _mode_parameter(mode: str) -> str:
    return f'parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "{mode}" }} }}\n'


def _execute_on(where: str) -> str:
    return f'parameters {{ key: "INPROCESS_EXECUTE_ON" value: {{ string_value: "{where}" }} }}\n'


LOOP = _mode_parameter("in_process") + _execute_on("event_loop")


def _parameters(mode: str, source: str) -> str:
    """A model's parameters in ``mode``; in ``event_loop``, a model that calls
    other models (or has an ``async def execute``) keeps its instance's thread,
    as the mode's documentation asks of such models."""
    if mode != "event_loop":
        return _mode_parameter(mode)
    if "exec(" in source or "async def execute" in source:
        return _mode_parameter("in_process") + _execute_on("instance_thread")
    return LOOP


# Where execute ran, and on whose time: INPUT0 is how many ms it sleeps.
WHERE_MODEL = """
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _trio_task():
    # The Trio task running this execute, on the event loop; None elsewhere.
    import trio

    try:
        return trio.lowlevel.current_task().name
    except RuntimeError:
        return None


class TritonPythonModel:
    def initialize(self, args):
        self.local = threading.local()
        self.local.set_in_initialize = True

    def execute(self, requests):
        import triton_python_backend_utils as late

        responses = []
        for request in requests:
            ms = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            time.sleep(ms / 1000)
            report = {
                "thread": threading.current_thread().name,
                "task": _trio_task(),
                "initialize_thread_local": getattr(self.local, "set_in_initialize", False),
                "late_import_is_ours": late.Tensor is pb_utils.Tensor,
            }
            pb_utils.Logger.log_info(f"where_loop ran on {report['thread']}")
            out = np.array([json.dumps(report).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""
WHERE_CONFIG = """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""
# Calls that would wait for the event loop from an execute running on it; INPUT0
# picks one: 0 a BLS exec(), 1 a BLS async_exec() on an asyncio loop of this
# thread, 2 the model loading API, 3 nothing (the model still serves).
WAITS_MODEL = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            called = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[
                    pb_utils.Tensor("INPUT0", np.zeros(16, np.int32)),
                    pb_utils.Tensor("INPUT1", np.zeros(16, np.int32)),
                ],
                requested_output_names=["OUTPUT0"],
            )
            if value == 0:
                called.exec()
            elif value == 1:
                async def call():
                    return await called.async_exec()

                asyncio.run(call())
            elif value == 2:
                pb_utils.is_model_ready("add_sub")
            out = np.array([value], np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""
# A decoupled ``async def execute`` is left running on its asyncio loop: allowed.
ASYNC_STREAM_MODEL = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            sender = request.get_response_sender()
            for index in range(value):
                await asyncio.sleep(0)
                out = np.array([index], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
            sender.send(flags=FINAL)
        return None
"""
ASYNC_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""
LOOP_MODELS = {
    "where_loop": (WHERE_CONFIG, WHERE_MODEL),
    "waits_loop": (base.ECHO, WAITS_MODEL),
    "async_stream_loop": (parity.DECOUPLED_ECHO, ASYNC_STREAM_MODEL),
}


def make_repository(root: Path, mode: str) -> Path:
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    models: dict[str, tuple[str, str]] = {
        name: base.MODELS[name]
        for name in (
            "errors",
            "sender",
            "add_sub",
            "bls_sync",
            "bls_async",
            "repeat",
            "bls_decoupled",
            "auto",
            "introspect",
        )
    }
    models.update(
        (name, parity.MODELS[name])
        for name in (
            "bls_bytes",
            "sender_rules",
            "cancel_child",
            "bls_cancel",
            "bls_count",
            "barrier_child",
            "bls_gather",
            "bls_async_stream",
            "poll_cancel",
            "raise_after_final",
        )
    )
    models.update(
        (name, qa.MODELS[name])
        for name in (
            *qa.READINESS,
            "countdown",
            "reschedule_once",
            "reschedule_with_response",
            "reschedule_not_iterative",
        )
    )
    models["globals_a"] = models["globals_b"] = (GLOBALS_CONFIG, GLOBALS_MODEL)
    helpers = {"introspect": 'GREETING = "hello from helper.py"\n'}
    helpers |= {name: f"WHO = {name!r}\n" for name in ("globals_a", "globals_b")}
    for name, (config, source) in models.items():
        config = f'name: "{name}"\nbackend: "python"\n' + config + _parameters(mode, source)
        files = {"1/helper.py": helpers[name]} if name in helpers else {}
        python_model(root, name, config, source, files)
    if mode == "event_loop":
        for name, (config, source) in LOOP_MODELS.items():
            python_model(root, name, f'name: "{name}"\nbackend: "python"\n' + config + LOOP, source)
        python_model(
            root,
            "async_loop",
            'name: "async_loop"\nbackend: "python"\n' + base.ECHO + LOOP,
            ASYNC_MODEL,
        )
    # Refused configurations: their loads fail, naming why.
    for name, parameters in BAD_CONFIGS.items():
        python_model(
            root,
            name,
            f'name: "{name}"\nbackend: "python"\n' + base.ECHO + parameters,
            base.ECHO_MODEL.format(special="                pass"),
        )
    config = metrics.CONFIG + _parameters(mode, metrics.MODEL)
    python_model(root, "metrics_model", config, metrics.MODEL)
    return root


@pytest.fixture(scope="module", params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def repository(tmp_path_factory, mode):
    return make_repository(tmp_path_factory.mktemp(f"python_{mode}"), mode)


@pytest.fixture(scope="module")
def server(repository):
    proc = ServerProcess(repository, args=["--exit-on-error=false"])
    try:
        proc.wait_ready()
        yield proc
        code = proc.stop()
        assert code == 0, f"server exited with {code}:\n{proc.output()}"
    finally:
        proc.close()


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield client
    client.close()


# -- what each mode promises of its own -----------------------------------------------


def test_each_model_has_its_own_pb_utils_and_helpers(client):
    """In either mode, model A's writes to pb_utils are not model B's, and each
    ``import helper`` finds the file beside its own model.py."""
    for name in ("globals_a", "globals_b"):
        infer_input = httpclient.InferInput("INPUT0", [1], "INT32")
        infer_input.set_data_from_numpy(np.array([0], dtype=np.int32))
        text = client.infer(name, [infer_input]).as_numpy("OUTPUT0")[0].decode()
        assert text == f"|{name}|{name}|{name}|int||{name}"


def test_where_the_model_runs(client, server, mode):
    infer_input = httpclient.InferInput("INPUT0", [1], "BYTES")
    infer_input.set_data_from_numpy(np.array([b"where"], dtype=np.object_))
    report = json.loads(client.infer("introspect", [infer_input]).as_numpy("OUTPUT0")[0])
    assert (report["pid"] == server.process.pid) == (mode != "stub"), report["pid"]


def test_execute_errors_are_worded_as_triton_words_them(client):
    with pytest.raises(InferenceServerException) as info:
        parity.echo(client, "sender_rules", 6)
    assert str(info.value.message()).startswith(
        "Failed to process the request(s) for model 'sender_rules_0_0', message: "
    ), info.value.message()
    assert "six is not served" in info.value.message()


# -- configuration ----------------------------------------------------------------------


def test_refused_configurations_fail_the_load_naming_why(client):
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["bad_mode"]["state"] == "UNAVAILABLE"
    assert (
        "parameter EXECUTION_MODE must be 'stub' or 'in_process', got 'threads'"
        in (rows["bad_mode"]["reason"])
    )
    assert rows["env_in_process"]["state"] == "UNAVAILABLE"
    assert (
        "EXECUTION_ENV_PATH cannot be used with EXECUTION_MODE 'in_process'"
        in (rows["env_in_process"]["reason"])
    )


def _settings(parameters: str) -> StubSettings:
    config = text_format.Parse(f'name: "m"\nbackend: "python"\n{parameters}', ModelConfig())
    return StubSettings.from_config(config, {})


def test_execution_mode_defaults_to_the_stub():
    assert _settings("").execution_mode == "stub"
    assert _settings(_mode_parameter("in_process")).execution_mode == "in_process"


def test_a_bad_execution_mode_is_named():
    with pytest.raises(InvalidArgument) as info:
        _settings(_mode_parameter("threads"))
    assert info.value.message == (
        "model 'm': parameter EXECUTION_MODE must be 'stub' or 'in_process', got 'threads'"
    )


def test_an_environment_of_its_own_is_refused_in_process():
    env = 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "env.tar.gz" } }\n'
    with pytest.raises(InvalidArgument) as info:
        _settings(env + _mode_parameter("in_process"))
    assert "EXECUTION_ENV_PATH cannot be used with EXECUTION_MODE 'in_process'" in (
        info.value.message
    )


def test_execute_on_must_name_a_place_and_needs_in_process():
    assert _settings(_mode_parameter("in_process")).execute_on == "instance_thread"
    assert _settings(LOOP).execute_on == "event_loop"
    with pytest.raises(InvalidArgument) as info:
        _settings(_mode_parameter("in_process") + _execute_on("loop"))
    assert info.value.message == (
        "model 'm': parameter INPROCESS_EXECUTE_ON must be 'instance_thread' or "
        "'event_loop', got 'loop'"
    )
    with pytest.raises(InvalidArgument) as info:
        _settings(_execute_on("event_loop"))
    assert "INPROCESS_EXECUTE_ON 'event_loop' needs EXECUTION_MODE 'in_process', got 'stub'" in (
        info.value.message
    )


# -- INPROCESS_EXECUTE_ON event_loop ------------------------------------------------------


@pytest.fixture
def loop_client(client, mode):
    if mode != "event_loop":
        pytest.skip("a test of INPROCESS_EXECUTE_ON 'event_loop' models")
    return client


def _where(client, ms: int = 0) -> dict:
    infer_input = httpclient.InferInput("INPUT0", [1], "INT32")
    infer_input.set_data_from_numpy(np.array([ms], dtype=np.int32))
    return json.loads(client.infer("where_loop", [infer_input]).as_numpy("OUTPUT0")[0])


def test_a_cheap_execute_runs_on_the_event_loop_a_long_one_moves_off_it(loop_client, server):
    """The first execute runs on the loop; one that took longer than the budget
    sends the next batch to the instance's thread (where initialize ran), and a
    cheap execute there brings the batches back to the loop."""
    instance_thread = "instance where_loop_0_0"
    first = _where(loop_client)
    assert first["thread"] != instance_thread, first
    # Thread-local state set in initialize is the instance thread's, as documented.
    assert first["initialize_thread_local"] is False
    assert first["late_import_is_ours"] is True
    # Idle, the instance took the request straight from the scheduler's submit:
    # it ran in the task that submitted it, not the executor's own.
    assert first["task"] is not None and "InstanceExecutor" not in first["task"], first
    parity.wait_for_log(server, f"where_loop ran on {first['thread']}")
    long = _where(loop_client, 20)  # 20 ms > the 1 ms budget
    after_long = _where(loop_client)
    assert after_long["thread"] == instance_thread, (long, after_long)
    assert after_long["initialize_thread_local"] is True
    sent = 3
    for _ in range(50):  # a cheap execute on the thread: back to the loop
        sent += 1
        if _where(loop_client)["thread"] != instance_thread:
            break
    else:
        raise AssertionError("the batches did not come back to the event loop")
    # Each counted once, wherever it ran (from the scheduler straight, or queued).
    (stats,) = loop_client.get_inference_statistics("where_loop")["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == sent
    assert stats["execution_count"] == sent


@pytest.mark.parametrize(
    "value, call", [(0, "exec()"), (1, "async_exec()"), (2, "model loading API")]
)
def test_a_call_that_would_wait_for_the_loop_fails_clearly(loop_client, value, call):
    """From an execute on the event loop, a BLS or model loading call would wait
    for the loop it blocks: it raises, naming the parameter, and the server goes
    on serving."""
    for _ in range(20):
        try:
            parity.echo(loop_client, "waits_loop", value)
        except InferenceServerException as exc:
            message = exc.message()
            break
        # It ran on the instance's thread (an execute before it took over the
        # budget: asyncio.run may, on a busy machine), where the call may wait.
    else:
        raise AssertionError(f"{call} never ran on the event loop")
    assert "cannot wait on the event loop's thread" in message, (call, message)
    assert "INPROCESS_EXECUTE_ON 'event_loop'" in message and "'instance_thread'" in message
    assert parity.echo(loop_client, "waits_loop", 3) == [3]


def test_an_async_execute_that_is_not_decoupled_is_refused(loop_client):
    rows = {row["name"]: row for row in loop_client.get_model_repository_index()}
    assert rows["async_loop"]["state"] == "UNAVAILABLE"
    assert (
        "INPROCESS_EXECUTE_ON 'event_loop' cannot wait for an 'async def execute'"
        in rows["async_loop"]["reason"]
    )


def test_a_decoupled_async_execute_runs_from_the_loop(loop_client, server):
    stream = Stream(server)
    try:
        stream.send("async_stream_loop", 3)
        values = []
        for _ in range(3):
            result, error = stream.next()
            assert error is None, error
            values.append(int(result.as_numpy("OUTPUT0")[0]))
        assert values == [0, 1, 2]
    finally:
        stream.close()
