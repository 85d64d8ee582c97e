"""The ONNX Runtime backend's call of a session (backends/onnxruntime/session_run.py):
the C session called without the Python wrapper's per-call checks gives what the
wrapper gives, results and errors, and the wrapper still does what that module
assumes of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state

from trionserve.backends.onnxruntime.session_run import KNOWN_WRAPPER, SessionRun, known_wrapper

SIMPLE = (
    Path(__file__).resolve().parents[2] / "examples" / "model_repository" / "simple" / "1"
) / "model.onnx"


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(str(SIMPLE), providers=["CPUExecutionProvider"])


def _feeds(rows: int = 2) -> dict[str, np.ndarray]:
    a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    return {"INPUT0": a, "INPUT1": np.ones_like(a)}


def test_the_installed_wrapper_is_the_one_session_run_knows(session):
    """If onnxruntime changes what ``InferenceSession.run`` does before or around
    its C session's ``run``, SessionRun calls the wrapper as it is (correct, and
    slower): this fails then, so that its shortcut is looked at again."""
    for name, names in KNOWN_WRAPPER.items():
        assert set(getattr(ort.InferenceSession, name).__code__.co_names) == names, name
    assert onnxruntime_pybind11_state.EPFail is ort.capi.onnxruntime_inference_collection.C.EPFail
    assert SessionRun(session)._direct


def test_a_wrapper_it_does_not_know_is_called_as_it_is(session, monkeypatch):
    class Changed(ort.InferenceSession):
        def run(self, output_names, input_feed, run_options=None):
            self._validate_something_new(input_feed)
            return super().run(output_names, input_feed, run_options)

    monkeypatch.setattr(session, "__class__", Changed)
    monkeypatch.setattr(Changed, "_validate_something_new", lambda self, feed: None, raising=False)
    assert not known_wrapper(session)
    calls = []
    monkeypatch.setattr(session, "run", lambda names, feeds: calls.append(names) or [])
    SessionRun(session)(["OUTPUT0"], _feeds())
    assert calls == [["OUTPUT0"]]


def test_results_are_the_wrappers(session):
    run = SessionRun(session)
    feeds = _feeds()
    for names in (["OUTPUT0", "OUTPUT1"], ["OUTPUT1"], []):
        ours, theirs = run(names, feeds), session.run(names, feeds)
        assert len(ours) == len(theirs)
        for mine, expected in zip(ours, theirs):
            np.testing.assert_array_equal(mine, expected)


def test_the_c_session_is_called_without_the_wrapper(session, monkeypatch):
    def wrapper(*args, **kwargs):
        raise AssertionError("the wrapper was called")

    monkeypatch.setattr(session, "run", wrapper)
    (out,) = SessionRun(session)(["OUTPUT0"], _feeds(1))
    np.testing.assert_array_equal(out, np.arange(16, dtype=np.int32).reshape(1, 16) + 1)


def _error(call) -> tuple[type, str]:
    with pytest.raises(Exception) as caught:
        call()
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "names, feeds",
    [
        (["OUTPUT0"], {"INPUT0": _feeds()["INPUT0"]}),  # a required input missing
        (["OUTPUT0"], {"INPUT0": _feeds()["INPUT0"], "INPUT1": np.ones((2, 16), np.float32)}),
        (["OUTPUT0"], {"INPUT0": np.ones((2, 15), np.int32), "INPUT1": np.ones((2, 15), np.int32)}),
        (["OUTPUT0"], {**_feeds(), "EXTRA": np.ones(1, np.int32)}),  # an input it does not have
        (["NOPE"], _feeds()),  # an output it does not have
    ],
    ids=["missing", "dtype", "shape", "extra input", "unknown output"],
)
def test_errors_are_the_wrappers(session, names, feeds):
    ours = _error(lambda: SessionRun(session)(names, feeds))
    theirs = _error(lambda: session.run(names, feeds))
    assert ours == theirs


def test_a_provider_failure_is_run_again_by_the_wrapper(session, monkeypatch):
    """The wrapper's fallback to other providers is kept: on EPFail the call goes
    to the wrapper (here stubbed: it answers)."""

    class Failing:
        def run(self, *args):
            raise onnxruntime_pybind11_state.EPFail("provider failed")

    run = SessionRun(session)
    answered = [np.zeros(1)]
    monkeypatch.setattr(session, "_sess", Failing())
    monkeypatch.setattr(session, "run", lambda names, feeds: answered)
    assert run(["OUTPUT0"], _feeds()) is answered


def test_graph_capture_on_sends_every_call_to_the_wrapper(session, monkeypatch):
    class Capturing:
        def is_webgpu_graph_capture_enabled(self):
            return True

    monkeypatch.setattr(session, "_sess", Capturing())
    run = SessionRun(session)
    answered = [np.zeros(1)]
    monkeypatch.setattr(session, "run", lambda names, feeds: answered)
    assert run(["OUTPUT0"], _feeds()) is answered


def _request(name: str, rows: np.ndarray, other: np.ndarray | None = None):
    from trionserve.core.inference import InferenceRequest, Tensor

    inputs = {"INPUT0": Tensor("INPUT0", "INT32", rows)}
    if other is not None:
        inputs["INPUT1"] = Tensor("INPUT1", "INT32", other)
    request = InferenceRequest(name, 1, inputs=inputs)
    request.batch_size = rows.shape[0]
    return request


def _load(directory: Path, name: str):
    from trionserve.actors import registry_entries
    from trionserve.backends.base import InstanceSpec, ModelContext
    from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend

    config = registry_entries.prepare_model(directory, autocomplete=True, override_json=None).config
    context = ModelContext(name, 1, config, directory, directory / "1")
    model = OnnxRuntimeBackend().load(context)
    return model.create_instance(InstanceSpec(f"{name}_0_0", f"{name}_0", "KIND_CPU", 0))


def test_an_instance_runs_a_batch_through_session_run_and_times_it():
    instance = _load(SIMPLE.parents[1], "simple")
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    requests = [_request("simple", a[:1], np.ones((1, 16), np.int32))]
    requests.append(_request("simple", a[1:], np.ones((1, 16), np.int32)))
    first, second = instance.execute(requests)
    np.testing.assert_array_equal(first.outputs[0].data, a[:1] + 1)
    np.testing.assert_array_equal(second.outputs[1].data, a[1:] - 1)
    assert [t.name for t in first.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert instance.compute_times is not None and min(instance.compute_times) >= 0


def test_an_output_in_the_gathered_input_buffer_outlives_the_next_batch(tmp_path):
    """An identity model's output may be its input: one gathered into the
    instance's reused buffer is copied out before the next batch overwrites it."""
    from onnx import TensorProto, helper, save

    directory = tmp_path / "identity"
    (directory / "1").mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["N", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["N", 4])],
    )
    save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
        directory / "1" / "model.onnx",
    )
    (directory / "config.pbtxt").write_text(
        'name: "identity"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
    )
    instance = _load(directory, "identity")
    batch = [_request("identity", np.full((1, 4), i, np.int32)) for i in range(2)]
    answers = instance.execute(batch)
    instance.execute([_request("identity", np.full((1, 4), 7, np.int32)) for _ in range(2)])
    for i, answer in enumerate(answers):
        np.testing.assert_array_equal(answer.outputs[0].data, np.full((1, 4), i, np.int32))


def test_a_lone_request_gets_every_output_in_the_models_order_or_those_it_asked_for():
    from trionserve.core.inference import RequestedOutput

    instance = _load(SIMPLE.parents[1], "simple")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    (every,) = instance.execute([_request("simple", a, np.ones_like(a))])
    assert [(t.name, t.datatype) for t in every.outputs] == [
        ("OUTPUT0", "INT32"),
        ("OUTPUT1", "INT32"),
    ]
    np.testing.assert_array_equal(every.outputs[1].data, a - 1)
    asking = _request("simple", a, np.ones_like(a))
    asking.id = "asked"
    asking.requested_outputs = [RequestedOutput("OUTPUT1"), RequestedOutput("OUTPUT0")]
    (asked,) = instance.execute([asking])
    assert asked.id == "asked"
    assert [t.name for t in asked.outputs] == ["OUTPUT1", "OUTPUT0"]
    np.testing.assert_array_equal(asked.outputs[0].data, a - 1)
    asking.requested_outputs = [RequestedOutput("OUTPUT1")]
    (one,) = instance.execute([asking])
    assert [t.name for t in one.outputs] == ["OUTPUT1"]


def test_a_lone_request_is_timed_and_a_failed_run_answers_it_with_the_backends_error():
    from trionserve.core.errors import InternalError

    instance = _load(SIMPLE.parents[1], "simple")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    request = _request("simple", a, np.ones_like(a))
    request.id = "lone"
    (response,) = instance.execute([request])
    assert response.id == "lone" and response.model_name == "simple"
    assert instance.compute_times is not None and min(instance.compute_times) >= 0

    def fails(names, feeds):
        raise RuntimeError("no memory")

    instance._run = fails
    (error,) = instance.execute([request])
    assert isinstance(error, InternalError)
    assert error.message == "onnxruntime execute failure for model 'simple': no memory"
