"""The Python backend's pure parts: shared-memory arenas, message framing with file
descriptors, settings, and the pb_utils API that models call directly."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.python.backend import may_auto_complete
from trionserve.backends.python.messages import (
    error_from_code,
    error_message,
    read_response,
    request_message,
)
from trionserve.backends.python.settings import StubSettings, settings_for
from trionserve.backends.python.shm import Arena, ArenaView, block_of
from trionserve.backends.python.stub import STUBPATH
from trionserve.backends.python.wire import BlockingChannel, Endpoint
from trionserve.core.errors import InvalidArgument, NotFound, Status, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

sys.path.insert(0, str(STUBPATH))
import triton_python_backend_utils as pb_utils  # noqa: E402

sys.path.remove(str(STUBPATH))


def test_arena_allocates_frees_and_coalesces():
    arena = Arena(4096, 8192)
    try:
        blocks = [arena.allocate(1000) for _ in range(4)]  # 1024 each: fills segment 0
        assert {b[0] for b in blocks} == {0}
        assert arena.in_use() == 4096
        extra = arena.allocate(10)  # no room: a growth segment
        assert extra[0] == 1 and arena.size == 4096 + 8192
        arena.free([blocks[1], blocks[2]])
        assert arena.allocate(2048)[1] == blocks[1][1]  # the two freed blocks merged
        arena.free([blocks[0], blocks[3], extra])
        segments, fds = arena.take_announcements()
        assert segments == [(0, 4096), (1, 8192)] and len(fds) == 2
        assert arena.take_announcements() == ([], [])
    finally:
        arena.close()


def connected_pair(default_size=4096, growth_size=4096):
    a, b = socket.socketpair()
    left = BlockingChannel(a, Endpoint(Arena(default_size, growth_size), ArenaView(), 1 << 20))
    right = BlockingChannel(b, Endpoint(Arena(default_size, growth_size), ArenaView(), 1 << 20))
    return left, right


def test_tensors_cross_through_shared_memory_and_blocks_come_back():
    left, right = connected_pair()
    try:
        tensors = {
            "f32": ("FP32", np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]),  # strided
            "bool": ("BOOL", np.array([True, False, True])),
            "bytes": ("BYTES", np.array([b"a", b"", "ü".encode(), b"x" * 5000], dtype=object)),
            "empty": ("INT64", np.zeros((0, 3), dtype=np.int64)),
            "big": ("UINT8", np.full(20_000, 7, dtype=np.uint8)),  # needs a growth segment
            "small_bytes": ("BYTES", np.array([b"ab", "ü".encode()], dtype=object)),
        }
        refs = [left.endpoint.arena.write(n, d, a)[0] for n, (d, a) in tensors.items()]
        # Small tensors travel in the message, with no block: only the two large ones take one.
        assert sorted(ref[0] for ref in refs if block_of(ref) is not None) == ["big", "bytes"]
        left.send({"op": "tensors", "refs": refs})
        message = right.receive()
        for ref in message["refs"]:
            datatype, expected = tensors[ref[0]]
            got = right.endpoint.view.array(ref, copy=True)
            assert ref[1] == datatype and got.shape == expected.shape
            assert got.tolist() == expected.tolist()
            if ref[1] != "BYTES":  # a model may write into its inputs, inline or not
                assert right.endpoint.view.array(ref, copy=False).flags.writeable
        # The reader gives the blocks back with its next message.
        assert left.endpoint.arena.in_use() > 0
        right.endpoint.release(block_of(ref) for ref in message["refs"])
        right.send({"op": "done"})
        assert left.receive() == {"op": "done"}
        assert left.endpoint.arena.in_use() == 0
    finally:
        for channel in (left, right):
            channel.sock.close()
            channel.endpoint.close()


def test_receive_returns_none_when_the_peer_is_gone():
    left, right = connected_pair()
    received = []
    reader = threading.Thread(target=lambda: received.append(right.receive()))
    reader.start()
    left.sock.close()
    reader.join(10)
    assert received == [None]
    right.sock.close()


def test_settings_from_parameters():
    config = ModelConfig(name="m")
    config.parameters["execute-timeout-seconds"].string_value = "2.5"
    config.parameters["stub-max-restarts"].string_value = "0"
    config.parameters["shm-default-byte-size"].string_value = "65536"
    settings = StubSettings.from_config(config, {})
    assert settings.execute_timeout == 2.5
    assert settings.max_restarts == 0
    assert settings.shm_default_byte_size == 65536
    config.parameters["shm-growth-byte-size"].string_value = "lots"
    with pytest.raises(InvalidArgument, match="'shm-growth-byte-size' must be a number"):
        StubSettings.from_config(config, {})
    config = ModelConfig(name="m")
    config.parameters["EXECUTION_ENV_PATH"].string_value = "$$TRITON_MODEL_DIRECTORY/env.tgz"
    assert StubSettings.from_config(config, {}).execution_env.endswith("/env.tgz")
    with pytest.raises(Unavailable, match=r"EXECUTION_ENV_PATH .*/m/env.tgz does not exist"):
        settings_for(config, Path("/nonexistent/m"), {})
    config = ModelConfig(name="m")
    config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "maybe"
    with pytest.raises(InvalidArgument, match="FORCE_CPU_ONLY_INPUT_TENSORS"):
        StubSettings.from_config(config, {})


def test_error_codes_map_both_ways():
    assert error_from_code(pb_utils.TritonError.NOT_FOUND, "x").status is Status.NOT_FOUND
    assert error_from_code(pb_utils.TritonError.UNSUPPORTED, "x").status is Status.UNIMPLEMENTED
    assert error_from_code(99, "x").status is Status.INTERNAL
    assert error_message(NotFound("gone"))[1] == (pb_utils.TritonError.NOT_FOUND, "gone")


def test_auto_complete_is_skipped_only_when_model_py_plainly_has_none(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("class TritonPythonModel:\n    def execute(self, requests):\n        pass\n")
    assert not may_auto_complete(path)
    path.write_text("from base import Base\nclass TritonPythonModel(Base):\n    pass\n")
    assert may_auto_complete(path)
    path.write_text(
        "class TritonPythonModel:\n    @staticmethod\n"
        "    def auto_complete_config(c):\n        return c\n"
    )
    assert may_auto_complete(path)


# -- pb_utils --------------------------------------------------------------------------


def model_config(**fields) -> pb_utils.ModelConfig:
    base = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    base.update(fields)
    return pb_utils.ModelConfig(json.dumps(base))


def test_model_config_completes_and_refuses_contradictions():
    config = model_config(input=[{"name": "X", "data_type": "TYPE_FP32", "dims": []}])
    config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_output({"name": "Y", "data_type": "TYPE_INT64", "dims": [-1]})
    config.set_max_batch_size(8)
    config.set_model_transaction_policy({"decoupled": True})
    assert config.as_dict()["input"] == [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}]
    assert config.as_dict()["output"][0]["name"] == "Y"
    assert config.as_dict()["max_batch_size"] == 8
    with pytest.raises(ValueError, match="expects datatype TYPE_FP32"):
        config.add_input({"name": "X", "data_type": "TYPE_INT8", "dims": [4]})
    with pytest.raises(ValueError, match="the model expects dims"):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "Z", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="max_batch_size 8"):
        config.set_max_batch_size(2)
    with pytest.raises(ValueError, match="decoupled"):
        config.set_model_transaction_policy({"decoupled": False})
    with pytest.raises(ValueError, match="sequence_batching"):
        model_config(sequence_batching={"max_sequence_idle_microseconds": 1}).set_dynamic_batching()


@pytest.mark.parametrize("kind", ["input", "output"])
def test_model_config_refuses_malformed_tensors_in_python_backends_words(kind):
    # qa/L0_model_config autofill_noplatform/python/{input,output}_{missing_name,
    # wrong_property}: python_backend's messages, word for word.
    add = getattr(model_config(), f"add_{kind}")
    allowed = (
        "'name', 'data_type', 'dims' and 'optional'"
        if kind == "input"
        else ("'name', 'data_type' and 'dims'")
    )
    with pytest.raises(ValueError) as info:
        add({"name": "T", "data_type": "TYPE_FP32", "dims": [4], "is_shape_tensor:": True})
    assert str(info.value) == (
        f"{kind} 'T' in auto-complete-config function for model 'm' contains property "
        f"other than {allowed}."
    )
    with pytest.raises(ValueError) as info:
        add({"data_type": "TYPE_FP32", "dims": [4]})
    assert str(info.value) == (
        f"{kind} in auto-complete-config function for model 'm' is missing 'name' property."
    )
    with pytest.raises(ValueError) as info:
        add({"name": "T", "dims": [4]})
    assert str(info.value) == (
        f"{kind} 'T' in auto-complete-config function for model 'm' is missing "
        "'data_type' property."
    )


def test_tensor_types_and_dlpack():
    tensor = pb_utils.Tensor("T", np.arange(6, dtype=np.float16).reshape(2, 3))
    assert tensor.name() == "T" and tensor.shape() == [2, 3] and tensor.is_cpu()
    assert tensor.triton_dtype() == 10
    again = pb_utils.Tensor.from_dlpack("U", tensor.to_dlpack())
    assert again.as_numpy().tolist() == tensor.as_numpy().tolist()
    assert pb_utils.Tensor.from_dlpack("V", np.ones(3, np.int32)).triton_dtype() == 8
    words = pb_utils.Tensor("W", np.array(["a", "b"]))
    assert words.triton_dtype() == 13 and words.as_numpy().dtype == np.object_
    assert pb_utils.triton_string_to_numpy("TYPE_INT32") is np.int32
    assert pb_utils.numpy_to_triton_type(np.bool_) == 1
    encoded = pb_utils.serialize_byte_tensor(np.array([b"ab", b"c"], dtype=object))
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == [b"ab", b"c"]
    # The one BYTES wire format (trionserve.core.bytes_tensor): a malformed buffer is
    # a clear error, not a silently short tensor.
    with pytest.raises(TritonError, match="element 0 has length 5, got only 2 bytes"):
        pb_utils.deserialize_bytes_tensor(b"\x05\x00\x00\x00ab")


def test_requests_responses_and_errors_validate_their_arguments():
    x = pb_utils.Tensor("X", np.zeros(2, np.float32))
    request = pb_utils.InferenceRequest(
        model_name="m", inputs=[x], requested_output_names=["Y"], parameters={"k": 1}
    )
    assert pb_utils.get_input_tensor_by_name(request, "X") is x
    assert json.loads(request.parameters()) == {"k": 1}
    with pytest.raises(TypeError, match="model_name"):
        pb_utils.InferenceRequest(inputs=[x], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException, match="parameters"):
        pb_utils.InferenceRequest(
            model_name="m", inputs=[], requested_output_names=[], parameters={"k": 1.5}
        )
    with pytest.raises(pb_utils.TritonModelException, match="must be a list"):
        pb_utils.InferenceResponse(output_tensors=(x,))
    error = pb_utils.TritonError("nope", pb_utils.TritonError.UNAVAILABLE)
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error() and response.error().code() == 4
    assert response.error().message() == "nope"
    with pytest.raises(pb_utils.TritonModelException, match="stub process"):
        request.exec()


# -- InferenceRequest: what backends hand over, as they sent it ------------------------


async def test_a_final_flag_after_the_last_response_is_streamed_on_its_own():
    from trionserve.core.inference import InferenceRequest, InferenceResponse

    request = InferenceRequest("m")
    last = InferenceResponse("m", "1", "", [], {})
    # Both arrive before the consumer wakes: the stream must not merge them.
    request.send(last, final=False)
    request.send(None, final=True)
    pairs = [pair async for pair in request.stream()]
    assert pairs == [(last, False), (None, True)]

    request = InferenceRequest("m")
    request.send(last, final=True)
    assert [pair async for pair in request.stream()] == [(last, True)]


def test_on_cancel_runs_once_when_the_request_is_cancelled():
    from trionserve.core.inference import InferenceRequest

    calls: list[str] = []
    request = InferenceRequest("m")
    request.on_cancel(lambda: calls.append("first"))
    request.on_cancel(None)  # removed: never called
    request.on_cancel(lambda: calls.append("second"))
    request.cancelled = True
    request.cancelled = True
    assert calls == ["second"]
    request.on_cancel(lambda: calls.append("late"))  # already cancelled: at once
    assert calls == ["second", "late"]


async def test_a_read_of_several_messages_lets_the_tasks_the_first_woke_run_first():
    """A stub that sent a burst (a fast model's tokens): the server handles the first
    message, and the task it woke (the stream writing its first token) runs before
    the rest are handled; whatever order Trio runs a batch of tasks in (20 rounds)."""
    import trio
    import trio.testing

    from trionserve.backends.python.process import TrioChannel

    stub_side, server_side = connected_pair()
    stub = SimpleNamespace(
        endpoint=server_side.endpoint,
        metrics=None,
        metrics_owner=0,
        control=None,
        sock=server_side.sock,
        lane=None,  # the execute path is not used here
    )
    channel = TrioChannel(stub)
    try:
        # The first message announces the stub's shared memory (descriptors end a read).
        stub_side.send({"op": "hello"})
        assert (await channel.receive())["op"] == "hello"
        for _ in range(20):
            for n in range(3):
                stub_side.send({"op": "token", "n": n})
            order: list = []
            woken = trio.Event()

            async def consumer(woken=woken, order=order):
                await woken.wait()
                order.append("written")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer)
                await trio.testing.wait_all_tasks_blocked()
                for _ in range(3):
                    message = await channel.receive()
                    order.append(message["n"])
                    woken.set()
            assert order == [0, "written", 1, 2]
    finally:
        channel.close()
        for side in (stub_side, server_side):
            side.sock.close()
            side.endpoint.close()


def test_a_stub_calls_tensors_cross_as_the_arena_writes_and_reads_them():
    """request_message and read_response take small numeric tensors inline
    without the arena's calls: the same references as Arena.write, the same
    arrays (writable, C order) as ArenaView.array."""
    left, right = connected_pair()
    try:
        tensors = {
            "f32": ("FP32", np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]),  # strided
            "bool": ("BOOL", np.array([True, False, True])),
            "int32": ("INT32", np.arange(16, dtype=np.int32).reshape(1, 16)),
            "bytes": ("BYTES", np.array([b"a", b"", "ü".encode(), b"x" * 5000], dtype=object)),
            "small_bytes": ("BYTES", np.array([b"ab", "ü".encode()], dtype=object)),
            "empty": ("INT64", np.zeros((0, 3), dtype=np.int64)),
            "big": ("UINT8", np.full(20_000, 7, dtype=np.uint8)),
        }
        request = InferenceRequest(
            "m", inputs={n: Tensor(n, d, a) for n, (d, a) in tensors.items()}
        )
        entry, blocks = request_message(1, request, left.endpoint, [])
        refs = entry[5]
        assert len(blocks) == 2  # "bytes" and "big"; the others ride in the message
        for ref in refs:
            datatype, array = tensors[ref[0]]
            written, block = left.endpoint.arena.write(ref[0], datatype, array)
            if block is None:
                assert ref == written
            else:  # another block of the same size
                assert ref[:3] == written[:3] and ref[5] == written[5]
                left.endpoint.arena.free([block])
        left.send({"op": "tensors", "refs": refs})
        message = right.receive()
        response = read_response((message["refs"], None, "{}"), right.endpoint, request, "1")
        assert isinstance(response, InferenceResponse)
        assert [t.name for t in response.outputs] == list(tensors)
        for tensor in response.outputs:
            datatype, expected = tensors[tensor.name]
            assert tensor.datatype == datatype and tensor.data.dtype == expected.dtype
            assert tensor.data.shape == expected.shape
            assert tensor.data.tolist() == expected.tolist()
            if datatype != "BYTES":
                assert tensor.data.flags.writeable and tensor.data.flags.c_contiguous
        right.send({"op": "done"})  # read_response gave the blocks back
        assert left.receive() == {"op": "done"}
        assert left.endpoint.arena.in_use() == 0
    finally:
        for channel in (left, right):
            channel.sock.close()
            channel.endpoint.close()
