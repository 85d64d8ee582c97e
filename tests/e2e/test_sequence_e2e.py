"""Stateful models end to end: a real server, ONNX accumulators, the official tritonclient.

The models are built with the onnx helper API into the test's own repository:

- ``seq_state``: OUTPUT = INPUT + INPUT_STATE with the sum kept as implicit state
  (zero initial state), direct strategy; it echoes its string CORRID control.
- ``seq_control``: the same sum, but the state starts at 100 (``initial_state`` from
  a data file) and the model itself drops it when its START control (FP32) says so;
  OUTPUT is multiplied by its READY control (INT32); oldest strategy.
- ``seq_one_slot``: one instance with one slot, for the backlog.
- ``seq_idle``: a 100 ms ``max_sequence_idle_microseconds``.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess

STATE = """
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
            dims: [ 1 ] initial_state: { data_type: TYPE_INT32 dims: [ 1 ] %s name: "init" } } ]
"""
ZERO = "zero_data: true"
TENSORS = """
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } %s ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

CONFIGS = {
    "seq_state": (
        8,
        ', { name: "CORRID_OUT" data_type: TYPE_STRING dims: [ 1 ] }',
        f"""
        direct {{ }}
        control_input [ {{ name: "CORRID" control [
            {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING }} ] }} ]
        {STATE % ZERO}""",
    ),
    "seq_control": (
        8,
        "",
        f"""
        oldest {{ max_candidate_sequences: 4 }}
        control_input [
          {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] }} ] }},
          {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
        ]
        {STATE % 'data_file: "hundred"'}""",
    ),
    "seq_one_slot": (1, "", f"direct {{ }}\n{STATE % ZERO}"),
    "seq_idle": (1, "", f"max_sequence_idle_microseconds: 100000\n{STATE % ZERO}"),
}


def tensor(name: str, elem_type: int = TensorProto.INT32):
    return helper.make_tensor_value_info(name, elem_type, ["batch", 1])


def model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "accumulator", inputs, outputs, list(initializers))
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built.ir_version = 8
    onnx.checker.check_model(built)
    return built


def accumulator(echo_corrid: bool = False) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["OUTPUT_STATE"]),
    ]
    inputs = [tensor("INPUT"), tensor("INPUT_STATE")]
    outputs = [tensor("OUTPUT"), tensor("OUTPUT_STATE")]
    if echo_corrid:
        nodes.append(helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]))
        inputs.append(tensor("CORRID", TensorProto.STRING))
        outputs.append(tensor("CORRID_OUT", TensorProto.STRING))
    return model(nodes, inputs, outputs)


def controlled_accumulator() -> onnx.ModelProto:
    """sum = INPUT + INPUT_STATE * (1 - START); OUTPUT = sum * READY."""
    one = helper.make_tensor("ONE", TensorProto.INT32, [1], [1])
    nodes = [
        helper.make_node("Cast", ["START"], ["START_I"], to=TensorProto.INT32),
        helper.make_node("Sub", ["ONE", "START_I"], ["KEEP"]),
        helper.make_node("Mul", ["INPUT_STATE", "KEEP"], ["CARRIED"]),
        helper.make_node("Add", ["INPUT", "CARRIED"], ["OUTPUT_STATE"]),
        helper.make_node("Mul", ["OUTPUT_STATE", "READY"], ["OUTPUT"]),
    ]
    inputs = [
        tensor("INPUT"),
        tensor("INPUT_STATE"),
        tensor("START", TensorProto.FLOAT),
        tensor("READY"),
    ]
    return model(nodes, inputs, [tensor("OUTPUT"), tensor("OUTPUT_STATE")], [one])


@pytest.fixture(scope="module")
def sequence_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("sequence_repository")
    graphs = {
        "seq_state": accumulator(echo_corrid=True),
        "seq_control": controlled_accumulator(),
        "seq_one_slot": accumulator(),
        "seq_idle": accumulator(),
    }
    for name, (max_batch_size, extra_outputs, batching) in CONFIGS.items():
        (repository / name / "1").mkdir(parents=True)
        onnx.save(graphs[name], str(repository / name / "1" / "model.onnx"))
        (repository / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
            f"{TENSORS % extra_outputs}\nsequence_batching {{\n{batching}\n}}\n"
        )
    (repository / "seq_control" / "initial_state").mkdir()
    (repository / "seq_control" / "initial_state" / "hundred").write_bytes(np.int32(100).tobytes())
    proc = ServerProcess(repository)
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@pytest.fixture
def http(sequence_server):
    client = httpclient.InferenceServerClient(sequence_server.http_url, concurrency=4)
    yield client
    client.close()


def http_inputs(value: int):
    infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [infer_input]


def grpc_inputs(value: int):
    infer_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [infer_input]


def add(http, model: str, seq, value: int, **flags) -> int:
    result = http.infer(model, http_inputs(value), sequence_id=seq, **flags)
    return int(result.as_numpy("OUTPUT")[0, 0])


def test_interleaved_sequences_keep_their_own_running_sums(http):
    sums = {seq: [] for seq in (101, 102, 103)}
    for step, value in enumerate([1, 2, 3, 4]):
        for seq in sums:
            flags = {"sequence_start": step == 0, "sequence_end": step == 3}
            sums[seq].append(add(http, "seq_state", seq, value * (seq - 100), **flags))
    assert sums == {101: [1, 3, 6, 10], 102: [2, 6, 12, 20], 103: [3, 9, 18, 30]}
    # END freed the slot and the state: the same id starts again from zero.
    assert add(http, "seq_state", 101, 7, sequence_start=True, sequence_end=True) == 7


def test_string_correlation_ids_reach_the_model(http):
    first = http.infer("seq_state", http_inputs(5), sequence_id="alpha", sequence_start=True)
    assert first.as_numpy("CORRID_OUT").reshape(-1).tolist() == [b"alpha"]
    assert add(http, "seq_state", "beta", 1, sequence_start=True) == 1
    assert add(http, "seq_state", "alpha", 6, sequence_end=True) == 11
    assert add(http, "seq_state", "beta", 2, sequence_end=True) == 3


def test_state_outputs_are_not_returned(http):
    result = http.infer(
        "seq_state", http_inputs(1), sequence_id=200, sequence_start=True, sequence_end=True
    )
    names = {output["name"] for output in result.get_response()["outputs"]}
    assert names == {"OUTPUT", "CORRID_OUT"}
    metadata = http.get_model_metadata("seq_control")
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT"]


def test_requests_outside_a_sequence_are_refused(http):
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        add(http, "seq_state", 999, 1)
    with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation"):
        add(http, "seq_state", 0, 1, sequence_start=True)


def test_a_start_for_a_sequence_in_progress_restarts_it_with_fresh_state(http, sequence_server):
    """As Triton: a second START on an open correlation id is no error; the
    sequence starts over from the initial state (a warning names the conflict)."""
    assert add(http, "seq_state", 300, 1, sequence_start=True) == 1
    assert add(http, "seq_state", 300, 4) == 5
    assert add(http, "seq_state", 300, 10, sequence_start=True) == 10
    assert add(http, "seq_state", 300, 2, sequence_end=True) == 12
    with grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}") as grpc:
        steps = ((3, True, False, 3), (7, True, False, 7), (1, False, True, 8))
        for value, start, end, expected in steps:
            infer_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            result = grpc.infer(
                "seq_state",
                [infer_input],
                sequence_id="restart",
                sequence_start=start,
                sequence_end=end,
            )
            assert int(result.as_numpy("OUTPUT")[0, 0]) == expected
    assert (
        "sequence 300 for model 'seq_state' has a conflict. The previous sequence did not "
        "end before this sequence start"
    ) in sequence_server.output()


def test_control_inputs_and_oldest_over_one_grpc_stream(sequence_server):
    """Four sequences interleaved on one ModelStreamInfer stream, sent without waiting."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        sequences = {1: [1, 2, 3], 2: [10, 20, 30], "three": [5, 5, 5], 4: [7, 0, 1]}
        for step in range(3):
            for seq, values in sequences.items():
                client.async_stream_infer(
                    "seq_control",
                    grpc_inputs(values[step]),
                    request_id=f"{seq}/{step}",
                    sequence_id=seq,
                    sequence_start=step == 0,
                    sequence_end=step == 2,
                )
        got: dict[str, list[int]] = {}
        for _ in range(12):
            result, error = results.get(timeout=30)
            assert error is None, error
            seq, step = result.get_response().id.split("/")
            got.setdefault(seq, []).append((int(step), int(result.as_numpy("OUTPUT")[0, 0])))
    finally:
        client.stop_stream()
        client.close()
    # The initial state is 100; START makes the model ignore it: sums start at 0.
    assert got == {
        "1": [(0, 1), (1, 3), (2, 6)],
        "2": [(0, 10), (1, 30), (2, 60)],
        "three": [(0, 5), (1, 10), (2, 15)],
        "4": [(0, 7), (1, 7), (2, 8)],
    }


def test_stream_errors_do_not_disturb_other_sequences(sequence_server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{sequence_server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            "seq_state", grpc_inputs(4), request_id="a", sequence_id=400, sequence_start=True
        )
        client.async_stream_infer(
            "seq_state", grpc_inputs(1), request_id="b", sequence_id=401
        )  # never started
        client.async_stream_infer(
            "seq_state", grpc_inputs(5), request_id="c", sequence_id=400, sequence_end=True
        )
        outcomes = [results.get(timeout=30) for _ in range(3)]
    finally:
        client.stop_stream()
        client.close()
    errors = [str(error) for _, error in outcomes if error is not None]
    sums = sorted(int(r.as_numpy("OUTPUT")[0, 0]) for r, e in outcomes if e is None)
    assert len(errors) == 1 and "must specify the START flag" in errors[0]
    assert sums == [4, 9]


def test_a_sequence_beyond_the_slots_waits_then_runs(http):
    assert add(http, "seq_one_slot", 1, 1, sequence_start=True) == 1
    waiting = http.async_infer("seq_one_slot", http_inputs(5), sequence_id=2, sequence_start=True)
    # While sequence 1 holds the only slot, a backlogged START with a timeout fails.
    with pytest.raises(InferenceServerException, match="timeout of the corresponding sequence"):
        http.infer(
            "seq_one_slot", http_inputs(1), sequence_id=3, sequence_start=True, timeout=100_000
        )
    assert add(http, "seq_one_slot", 1, 2, sequence_end=True) == 3
    assert int(waiting.get_result().as_numpy("OUTPUT")[0, 0]) == 5
    assert add(http, "seq_one_slot", 2, 1, sequence_end=True) == 6


def test_an_idle_sequence_is_released_and_a_late_request_is_refused(http):
    assert add(http, "seq_idle", 9, 1, sequence_start=True) == 1
    time.sleep(0.3)  # more than the 100 ms idle limit has certainly passed
    with pytest.raises(InferenceServerException, match="idle for more than 100000 us"):
        add(http, "seq_idle", 9, 2)
    # Its slot (the only one) was freed: a new sequence runs at once.
    assert add(http, "seq_idle", 10, 4, sequence_start=True, sequence_end=True) == 4


def test_the_example_accumulate_model(http_client):
    """examples/model_repository/accumulate, served by the shared example server."""
    totals = []
    for step, value in enumerate([3, 4, 5]):
        result = http_client.infer(
            "accumulate",
            http_inputs(value),
            sequence_id="example",
            sequence_start=step == 0,
            sequence_end=step == 2,
        )
        totals.append(int(result.as_numpy("OUTPUT")[0, 0]))
    assert totals == [3, 7, 12]
