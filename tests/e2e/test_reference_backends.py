"""Triton's test backends (``identity``, ``repeat``, ``square``, ``sequence``,
``dyna_sequence``, ``implicit_state``, ``iterative_sequence``, ``minimal``,
``recommended``) through a real
server and the official clients, with the configs Triton's QA gives them
(server src/test/models, qa/custom_models, qa/L0_implicit_state/models)."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess

IO = """
input [ {{ name: "{i}" data_type: {t} dims: [ {d} ] {extra} }} ]
output [ {{ name: "{o}" data_type: {t} dims: [ {d} ] }} ]
"""


def _io(name_in: str, name_out: str, dtype: str, dims: str, extra: str = "") -> str:
    return IO.format(i=name_in, o=name_out, t=dtype, d=dims, extra=extra)


def _controls(*names: str, kind: str = "int32_false_true", corrid: str = "") -> str:
    entries = [
        f'{{ name: "{n}" control [ {{ kind: CONTROL_SEQUENCE_{n} {kind}: [ 0, 1 ] }} ] }}'
        for n in names
    ]
    if corrid:
        entries.append(
            '{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID '
            f"data_type: {corrid} }} ] }}"
        )
    return "control_input [ " + ", ".join(entries) + " ]"


ADDSUB_IO = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""

IMPLICIT_IO = """
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "TEST_CASE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
STATE = """state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE"
  data_type: TYPE_INT32 dims: 1 initial_state: { name: "init" data_type: TYPE_INT32
  dims: 1 zero_data: true } } ]"""
IMPLICIT_CONTROLS = _controls("START", "READY", "END", kind="fp32_false_true")

MODELS = {
    "identity_fp32": 'backend: "identity"\nmax_batch_size: 1\n'
    + _io("INPUT0", "OUTPUT0", "TYPE_FP32", "-1"),
    "identity_uint32": 'backend: "identity"\nmax_batch_size: 8\n'
    + _io("INPUT0", "OUTPUT0", "TYPE_UINT32", "-1")
    + "dynamic_batching { preferred_batch_size: [8], max_queue_delay_microseconds: 3000000 }",
    "identity_bytes": 'backend: "identity"\nmax_batch_size: 0\n'
    + _io("INPUT0", "OUTPUT0", "TYPE_STRING", "-1"),
    "identity_optional": """backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 2 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ -1, 3 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 2 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]""",
    # As Triton's qa reshape models: the backend sees INPUT0 as [16] and the
    # output shows its dims.
    "identity_reshape": """backend: "identity"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4, 4 ] reshape: { shape: [ 16 ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]""",
    "ens_reshape": """platform: "ensemble"
max_batch_size: 8
ensemble_scheduling { step [ { model_name: "identity_reshape_16" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } } ] }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 8 ] reshape: { shape: [ 16 ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4, 4 ] reshape: { shape: [ 16 ] } } ]""",
    "identity_reshape_16": 'backend: "identity"\nmax_batch_size: 8\n'
    + _io("INPUT0", "OUTPUT0", "TYPE_FP32", "16"),
    "identity_bad": 'backend: "identity"\nmax_batch_size: 0\n'
    + _io("INPUT0", "RESULT0", "TYPE_FP32", "1"),
    "repeat_int32": """backend: "repeat"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]""",
    "repeat_batched": """backend: "repeat"
max_batch_size: 4
model_transaction_policy { decoupled: True }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]""",
    "repeat_not_decoupled": """backend: "repeat"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]""",
    # As qa/L0_decoupled's simple_repeat: an ensemble over a decoupled step, not
    # itself declared decoupled.
    "ens_repeat": """platform: "ensemble"
max_batch_size: 0
ensemble_scheduling { step [ { model_name: "repeat_int32" model_version: -1
  input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" }
  input_map { key: "WAIT" value: "WAIT" } output_map { key: "OUT" value: "OUT" }
  output_map { key: "IDX" value: "IDX" } } ] }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]""",
    # qa/L0_response_cache's ensemble_cache_composing_decoupled: decoupled through
    # its step, so the cache it asks for is refused as for a decoupled model.
    "ens_repeat_cached": """platform: "ensemble"
max_batch_size: 0
response_cache { enable: true }
ensemble_scheduling { step [ { model_name: "repeat_int32" model_version: -1
  input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" }
  input_map { key: "WAIT" value: "WAIT" } output_map { key: "OUT" value: "OUT" }
  output_map { key: "IDX" value: "IDX" } } ] }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]""",
    "square_int32": 'backend: "square"\nmax_batch_size: 0\n'
    "model_transaction_policy { decoupled: True }\n" + _io("IN", "OUT", "TYPE_INT32", "1"),
    "square_failing": 'backend: "square"\nmax_batch_size: 0\n'
    "model_transaction_policy { decoupled: True }\n"
    + _io("IN", "OUT", "TYPE_INT32", "1")
    + 'parameters [ { key: "CUSTOM_FAIL_COUNT" value: { string_value: "1" } } ]',
    "custom_sequence_int32": 'backend: "sequence"\nmax_batch_size: 4\n'
    "sequence_batching { max_sequence_idle_microseconds: 5000000 "
    + _controls("START", "READY")
    + " }\n"
    + _io("INPUT", "OUTPUT", "TYPE_INT32", "1"),
    "custom_dyna_sequence_int32": 'backend: "dyna_sequence"\nmax_batch_size: 8\n'
    "sequence_batching { max_sequence_idle_microseconds: 5000000 oldest { "
    "max_candidate_sequences: 6 preferred_batch_size: [ 4 ] } "
    + _controls("START", "END", "READY", corrid="TYPE_UINT64")
    + " }\n"
    + _io("INPUT", "OUTPUT", "TYPE_INT32", "-1"),
    "no_implicit_state": 'backend: "implicit_state"\nmax_batch_size: 0\n'
    f"sequence_batching {{ {IMPLICIT_CONTROLS} }}\n{IMPLICIT_IO}",
    "no_state_update": 'backend: "implicit_state"\nmax_batch_size: 0\n'
    f"sequence_batching {{ {IMPLICIT_CONTROLS}\n{STATE} }}\n{IMPLICIT_IO}",
    "minimal_batching": 'backend: "minimal"\nmax_batch_size: 8\n'
    + _io("IN0", "OUT0", "TYPE_INT32", "4")
    + "dynamic_batching { max_queue_delay_microseconds: 2000000 preferred_batch_size: [ 2 ] }",
    "recommended": 'backend: "recommended"\nmax_batch_size: 8\n'
    + _io("INPUT", "OUTPUT", "TYPE_FP32", "4, 4"),
    # backend/examples/model_repos/bls_models: the two models the bls backend
    # calls are identity models here (a Python and an ONNX model there).
    "bls_fp32": 'backend: "bls"\nmax_batch_size: 0\n' + ADDSUB_IO,
    "addsub_python": 'backend: "identity"\nmax_batch_size: 0\n' + ADDSUB_IO,
    "addsub_onnx": 'backend: "identity"\nmax_batch_size: 0\n' + ADDSUB_IO,
    "bls_batching": 'backend: "bls"\nmax_batch_size: 4\n' + ADDSUB_IO,
    "bls_int32": 'backend: "bls"\nmax_batch_size: 0\n'
    + ADDSUB_IO.replace("TYPE_FP32", "TYPE_INT32", 1),
    # qa/L0_iterative_sequence/models/iterative_sequence, and the scheduler its
    # test_unsupported_dynamic_scheduler gives it.
    "iterative_sequence": 'backend: "iterative_sequence"\nmax_batch_size: 1\n'
    "model_transaction_policy { decoupled: True }\n"
    "sequence_batching { iterative_sequence: true }\n" + _io("INPUT", "OUTPUT", "TYPE_INT32", "1"),
    "iterative_dynamic": 'backend: "iterative_sequence"\nmax_batch_size: 1\n'
    "model_transaction_policy { decoupled: True }\n"
    "dynamic_batching { }\n" + _io("INPUT", "OUTPUT", "TYPE_INT32", "1"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("reference_models")
    for name, config in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}\n')
    proc = ServerProcess(
        root, args=["--log-verbose=1", "--exit-on-error=false", "--strict-readiness=false"]
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
    finally:
        proc.close()


@pytest.fixture
def http(server):
    client = httpclient.InferenceServerClient(server.http_url, concurrency=4)
    yield client
    client.close()


@pytest.fixture
def stream(server):
    """A gRPC client with a started stream; responses land on ``client.results``."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.results = results
    yield client
    client.stop_stream()
    client.close()


def _input(name: str, array: np.ndarray, dtype: str, module=httpclient):
    tensor = module.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_identity_echoes_each_type_with_triton_parameters(http):
    for model, array, dtype in (
        ("identity_fp32", np.array([[1.5, -2.0, 3.25]], np.float32), "FP32"),
        ("identity_fp32", np.zeros((1, 0), np.float32), "FP32"),
        ("identity_bytes", np.array([b"16384", b"", b"\x00a"], dtype=object), "BYTES"),
    ):
        result = http.infer(model, [_input("INPUT0", array, dtype)])
        output = result.as_numpy("OUTPUT0")
        assert output.shape == array.shape and output.tolist() == array.tolist()
        assert result.get_response()["parameters"] == {
            "param0": "an example string parameter",
            "param1": 42,
            "param2": False,
            "param3": 123.123,
        }


def test_bytes_that_are_not_utf8_are_refused_as_json_and_kept_as_binary(http):
    # qa/L0_string_io string_client_test.py test_unicode_bytes, its HTTP clients.
    array = np.array([b"\n\xfa\x03\x94", b"ok"], dtype=object)
    as_json = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    with pytest.raises(InferenceServerException, match="not UTF-8 text") as info:
        http.infer("identity_bytes", [_input("INPUT0", array, "BYTES")], outputs=as_json)
    assert info.value.status() == "400"
    result = http.infer("identity_bytes", [_input("INPUT0", array, "BYTES")])
    assert result.as_numpy("OUTPUT0").tolist() == array.tolist()


def test_identity_batches_and_counts_input_bytes(server, http):
    arrays = [np.arange(4, dtype=np.uint32).reshape(2, 2) + i for i in range(4)]
    pending = [http.async_infer("identity_uint32", [_input("INPUT0", a, "UINT32")]) for a in arrays]
    for array, request in zip(arrays, pending):
        assert request.get_result().as_numpy("OUTPUT0").tolist() == array.tolist()
    stats = http.get_inference_statistics("identity_uint32")["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (8, 1)
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text
    line = 'input_byte_size_counter{model="identity_uint32",version="1"}'
    assert any(
        row.startswith(line) and float(row[len(line) :]) == 64 for row in metrics.split("\n")
    )
    log = server.output()
    # Escaped in the record, as Triton escapes its backend's LOG_MESSAGE.
    assert (
        "\\tinput INPUT0: datatype = UINT32, shape = [2,2], byte_size = 16, buffer_count = 1" in log
    )


def test_reshapes_of_a_model_and_of_an_ensemble(http):
    data = np.arange(32, dtype=np.float32).reshape(2, 4, 4)
    result = http.infer("identity_reshape", [_input("INPUT0", data, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == data.reshape(2, 16).tolist()
    # core ensemble_utils.cc: the ensemble's own tensors meet its steps in their
    # reshape shape; the response shows the output's dims.
    data = np.arange(32, dtype=np.float32).reshape(2, 2, 8)
    result = http.infer("ens_reshape", [_input("INPUT0", data, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == data.reshape(2, 4, 4).tolist()


def test_identity_optional_input_gives_zeros_and_a_missing_one_is_refused(http):
    first = _input("INPUT0", np.array([7, 8], np.int32), "INT32")
    result = http.infer("identity_optional", [first])
    assert result.as_numpy("OUTPUT0").tolist() == [7, 8]
    zeros = result.as_numpy("OUTPUT1")
    assert zeros.dtype == np.float32 and zeros.shape == (1, 3) and not zeros.any()
    asked = [httpclient.InferRequestedOutput("OUTPUT1")]
    given = _input("INPUT1", np.ones((2, 3), np.float32), "FP32")
    result = http.infer("identity_optional", [first, given], outputs=asked)
    assert result.as_numpy("OUTPUT1").tolist() == np.ones((2, 3)).tolist()
    assert result.as_numpy("OUTPUT0") is None


def test_a_config_the_backend_refuses_fails_its_load_with_the_reason(http):
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["identity_bad"]["state"] == "UNAVAILABLE"
    assert (
        "expected output name to follow OUTPUT<index> pattern, got 'RESULT0'"
        in (index["identity_bad"]["reason"])
    )
    assert index["ens_repeat_cached"]["state"] == "UNAVAILABLE"
    assert (
        "Response Cache does not currently support model ens_repeat_cached with "
        "'decoupled' transaction policy" in index["ens_repeat_cached"]["reason"]
    )
    assert index["repeat_batched"]["state"] == "UNAVAILABLE"
    assert (
        "repeat backend only supports models with max_batch_size == 0"
        in (index["repeat_batched"]["reason"])
    )


def _drain(client, count: int) -> list:
    out = []
    for _ in range(count):
        result, error = client.results.get(timeout=10)
        out.append(error if error is not None else result)
    return out


def test_repeat_streams_one_response_per_element_then_the_final_flag(stream):
    inputs = [
        _input("IN", np.array([4, -2, 9], np.int32), "INT32", grpcclient),
        _input("DELAY", np.array([1, 1, 1], np.uint32), "UINT32", grpcclient),
        _input("WAIT", np.array([0], np.uint32), "UINT32", grpcclient),
    ]
    stream.async_stream_infer("repeat_int32", inputs, enable_empty_final_response=True)
    results = _drain(stream, 4)
    assert [r.as_numpy("OUT").tolist() for r in results[:3]] == [[4], [-2], [9]]
    assert [r.as_numpy("IDX").tolist() for r in results[:3]] == [[0], [1], [2]]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False, False, False, True] and results[3].as_numpy("OUT") is None
    mismatched = inputs[:1] + [
        _input("DELAY", np.array([1], np.uint32), "UINT32", grpcclient),
        inputs[2],
    ]
    stream.async_stream_infer("repeat_int32", mismatched)
    (error,) = _drain(stream, 1)
    assert isinstance(error, InferenceServerException)
    assert "expected IN and DELAY shape to match, got [3] and [1]" in error.message()


def test_a_model_that_is_not_decoupled_gets_the_first_of_several_responses(http):
    # qa/L0_grpc_state_cleanup test_non_decoupled_streaming_multi_response.
    inputs = [
        _input("IN", np.array([100, 101, 102, 103], np.int32), "INT32"),
        _input("DELAY", np.zeros(4, np.uint32), "UINT32"),
        _input("WAIT", np.array([0], np.uint32), "UINT32"),
    ]
    result = http.infer("repeat_not_decoupled", inputs)
    assert result.as_numpy("OUT").tolist() == [100]
    assert result.as_numpy("IDX").tolist() == [0]


def test_an_ensemble_with_a_decoupled_step_is_decoupled_and_streams_unordered(http, stream):
    # core ensemble_utils.cc sets such an ensemble decoupled; a gRPC stream then
    # answers as responses come (qa/L0_decoupled test_response_order).
    assert http.get_model_config("ens_repeat")["model_transaction_policy"]["decoupled"]

    def inputs(delay_ms: int) -> list:
        return [
            _input("IN", np.array([1, 2], np.int32), "INT32", grpcclient),
            _input("DELAY", np.array([delay_ms, delay_ms], np.uint32), "UINT32", grpcclient),
            _input("WAIT", np.array([0], np.uint32), "UINT32", grpcclient),
        ]

    stream.async_stream_infer("ens_repeat", inputs(400), request_id="slow")
    stream.async_stream_infer("ens_repeat", inputs(1), request_id="fast")
    order = [r.get_response().id for r in _drain(stream, 4)]
    assert order[:2] == ["fast", "fast"], order


def test_a_failed_ensemble_request_counts_twice_as_other(server, http, stream):
    # core ensemble_scheduler.cc: RespondIfError and the release each count the
    # failure, reason OTHER (qa/L0_model_queue test_policy_reject expects it).
    def failures() -> tuple[int, float]:
        stats = http.get_inference_statistics("ens_repeat")["model_stats"][0]
        text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text
        line = 'nv_inference_request_failure{model="ens_repeat",reason="OTHER",version="1"} '
        other = [float(row[len(line) :]) for row in text.split("\n") if row.startswith(line)]
        return stats["inference_stats"]["fail"]["count"], other[0] if other else 0.0

    before = failures()
    mismatched = [
        _input("IN", np.array([1, 2], np.int32), "INT32", grpcclient),
        _input("DELAY", np.array([1], np.uint32), "UINT32", grpcclient),
        _input("WAIT", np.array([0], np.uint32), "UINT32", grpcclient),
    ]
    stream.async_stream_infer("ens_repeat", mismatched)
    (error,) = _drain(stream, 1)
    assert isinstance(error, InferenceServerException)
    after = failures()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2.0)


def test_square_answers_n_times_and_its_simulated_failure_ends_the_request(stream):
    stream.async_stream_infer(
        "square_int32", [_input("IN", np.array([3], np.int32), "INT32", grpcclient)]
    )
    assert [r.as_numpy("OUT").tolist() for r in _drain(stream, 3)] == [[3], [3], [3]]
    stream.async_stream_infer(
        "square_failing", [_input("IN", np.array([2], np.int32), "INT32", grpcclient)]
    )
    first, error = _drain(stream, 2)
    assert first.as_numpy("OUT").tolist() == [2]
    assert isinstance(error, InferenceServerException) and "simulated failure" in error.message()


def _sequence(http, model, corrid, values, inputs=None):
    out = []
    for index, value in enumerate(values):
        tensor = _input("INPUT", np.array([[value]], np.int32), "INT32")
        result = http.infer(
            model,
            inputs or [tensor],
            sequence_id=corrid,
            sequence_start=index == 0,
            sequence_end=index == len(values) - 1,
        )
        out.append(result.as_numpy("OUTPUT").reshape(-1).tolist())
    return out


def test_sequence_accumulates_per_slot(http):
    assert _sequence(http, "custom_sequence_int32", 11, [1, 2, 3]) == [[1], [3], [6]]
    assert _sequence(http, "custom_sequence_int32", 12, [5, 5]) == [[5], [10]]


def test_dyna_sequence_adds_the_correlation_id_at_the_end(http):
    assert _sequence(http, "custom_dyna_sequence_int32", 1000, [1, 2, 3]) == [[1], [3], [1006]]


def _implicit(http, model, test_case, corrid, start=True, end=False, value=1):
    return http.infer(
        model,
        [
            _input("INPUT", np.array([value], np.int32), "INT32"),
            _input("TEST_CASE", np.array([test_case], np.int32), "INT32"),
        ],
        sequence_id=corrid,
        sequence_start=start,
        sequence_end=end,
    )


def test_implicit_state_errors_and_a_state_never_updated(http):
    with pytest.raises(InferenceServerException) as missing:
        _implicit(http, "no_implicit_state", 0, 1)
    assert (
        "unable to add state 'undefined_state'. State configuration is missing for model "
        "'no_implicit_state'." in missing.value.message()
    )
    with pytest.raises(InferenceServerException) as wrong:
        _implicit(http, "no_state_update", 0, 2)
    assert "state 'undefined_state' is not a valid state name." in wrong.value.message()
    outputs = [
        _implicit(http, "no_state_update", 1, 3, start=i == 0, end=i == 4).as_numpy("OUTPUT")
        for i in range(5)
    ]
    assert [o.tolist() for o in outputs] == [[1]] * 5


def test_minimal_and_recommended_return_their_input_batched(http):
    arrays = [np.arange(4, dtype=np.int32).reshape(1, 4) * k for k in (1, 2)]
    pending = [http.async_infer("minimal_batching", [_input("IN0", a, "INT32")]) for a in arrays]
    assert [p.get_result().as_numpy("OUT0").tolist() for p in pending] == [
        a.tolist() for a in arrays
    ]
    stats = http.get_inference_statistics("minimal_batching")["model_stats"][0]
    assert stats["execution_count"] == 1
    array = np.random.default_rng(0).random((2, 4, 4), dtype=np.float32)
    result = http.infer("recommended", [_input("INPUT", array, "FP32")])
    assert result.as_numpy("OUTPUT").tolist() == array.tolist()


def test_bls_sends_each_request_to_both_models_and_joins_their_outputs(http):
    rng = np.random.default_rng(1)
    a, b = (rng.random(16, dtype=np.float32) for _ in range(2))
    result = http.infer(
        "bls_fp32",
        [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "FP32")],
        request_id="7",
    )
    assert result.get_response()["id"] == "7"
    # OUTPUT0 is output 0 of addsub_python's response, OUTPUT1 output 1 of
    # addsub_onnx's (bls.cc ConstructFinalResponse).
    assert result.as_numpy("OUTPUT0").tolist() == a.tolist()
    assert result.as_numpy("OUTPUT1").tolist() == b.tolist()
    for model in ("addsub_python", "addsub_onnx"):
        stats = http.get_inference_statistics(model)["model_stats"][0]
        assert stats["inference_count"] == 1


def test_bls_refuses_configs_its_example_refuses(http):
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["bls_batching"]["state"] == "UNAVAILABLE"
    assert (
        "bls backend only supports models with max_batch_size == 0"
        in (index["bls_batching"]["reason"])
    )
    assert index["bls_int32"]["state"] == "UNAVAILABLE"
    assert (
        "expected INPUT0 datatype to be TYPE_FP32, got TYPE_INT32" in (index["bls_int32"]["reason"])
    )


def test_iterative_sequence_counts_down_one_execution_at_a_time(stream):
    # server src/test/iterative_sequence: INPUT = 2 gives OUTPUT 1, the request
    # handed back to the iterative sequence batcher, then OUTPUT 0 as the final
    # response; under a dynamic batcher the hand-back is refused with core's
    # infer_request.cc error.
    inputs = [_input("INPUT", np.array([[2]], np.int32), "INT32", grpcclient)]
    stream.async_stream_infer("iterative_sequence", inputs)
    first, last = _drain(stream, 2)
    assert first.as_numpy("OUTPUT").tolist() == [[1]]
    assert last.as_numpy("OUTPUT").tolist() == [[0]]
    assert last.get_response().parameters["triton_final_response"].bool_param
    stream.async_stream_infer("iterative_dynamic", inputs)
    (error,) = _drain(stream, 1)
    assert isinstance(error, InferenceServerException)
    assert error.message() == (
        "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the "
        "model is not configured to handle such a flag."
    )
