"""benchmarks/investigations/profile_peers_cnn.py: both servers' threads sorted into
groups, the groups' CPU split by step, and the repository both servers read."""

from __future__ import annotations

import pytest

from benchmarks.investigations import profile_peers as pp
from benchmarks.investigations.profile_peers_cnn import (
    BACKEND_THREAD,
    CORE_THREADS,
    FRONTEND,
    INSTANCE_THREADS,
    LOOP_THREAD,
    OTHER_THREADS,
    STUB,
    Row,
    read_pyspy_threads,
    thread_group,
    write_repository,
)
from trionserve.repository.config import read_model_config


def test_triton_s_threads_go_by_what_their_own_samples_did():
    # An HTTP worker: mostly the kernel receiving the body and polling, some libevhtp.
    http = {pp.KERNEL_NET: 41, pp.KERNEL_POLL: 20, pp.LIBC: 18, pp.HTTP: 11, pp.CORE: 4}
    assert thread_group("triton", "server", "tritonserver", http) == FRONTEND
    # The model instance's thread: the Python backend's server side, its waits.
    backend = {pp.LIBC: 13, pp.IPC_SERVER: 9, pp.KERNEL_FUTEX: 8, pp.CORE: 4, pp.HANDLER: 2}
    assert thread_group("triton", "server", "tritonserver", backend) == BACKEND_THREAD
    # Under gRPC it also serializes and writes the answers: still the backend's.
    grpc_backend = {pp.IPC_SERVER: 27, pp.KERNEL_NET: 16, pp.GRPC: 15, pp.CORE: 15,
                    pp.PROTOBUF: 10, pp.KERNEL_FUTEX: 10, pp.LIBC: 7}  # fmt: skip
    assert thread_group("triton", "server", "tritonserver", grpc_backend) == BACKEND_THREAD
    # The dynamic batcher: the core's frames, and wake-ups that vote for nobody.
    batcher = {pp.KERNEL_FUTEX: 30, pp.CORE: 5, pp.LIBC: 2}
    assert thread_group("triton", "server", "tritonserver", batcher) == CORE_THREADS
    # gRPC's library threads name themselves; a thread that did nothing named is other.
    assert thread_group("triton", "server", "default-executo", {}) == FRONTEND
    assert thread_group("triton", "server", "tritonserver", {pp.KERNEL_FUTEX: 3}) == OTHER_THREADS
    assert thread_group("triton", "stub", "triton_python_b", {pp.MODEL: 50}) == STUB


def test_trionserve_s_threads_go_by_their_names_and_stubs_by_process():
    assert thread_group("stub", "server", "main", {pp.INTERPRETER: 9}) == LOOP_THREAD
    assert thread_group("onnx", "server", "instance cnn_on", {pp.MODEL: 9}) == INSTANCE_THREADS
    assert thread_group("inproc", "server", "python", {pp.INTERPRETER: 1}) == OTHER_THREADS
    assert thread_group("stub", "stub", "main", {pp.INTERPRETER: 9}) == STUB


def _stack(*frames: str, count: int) -> str:
    return ";".join(frames) + f" {count}"


def test_py_spy_s_stacks_go_to_the_os_thread_that_held_the_gil():
    server = 'process 100:"python -m trionserve"'
    loop = [server, "thread (100): MainThread", "<module> (trionserve/__main__.py:3)",
            "unrolled_run (trio/_core/_run.py:2866)"]  # fmt: skip
    instance = [server, "thread (101): instance cnn_py_0_0", "_bootstrap (threading.py:1002)",
                "execute (/tmp/models/cnn_py/1/model.py:30)"]  # fmt: skip
    # A stub's stacks name the server's process, then the stub's, then its thread.
    stub = [server, 'process 200:"python -P -c ... stub"', "thread (200): MainThread",
            "_reply (trionserve/backends/python/stub.py:294)"]  # fmt: skip
    text = "\n".join(
        [_stack(*loop, count=5), _stack(*instance, count=3), _stack(*stub, count=4),
         _stack("unrolled_run (trio/_core/_run.py:2866)", count=1)]
    )  # fmt: skip
    threads = read_pyspy_threads(text)
    assert {tid: p.total for tid, p in threads.items()} == {100: 5, 101: 3, 200: 4, 0: 1}
    assert threads[100].samples == {pp.LOOP: 5}
    assert threads[101].samples == {pp.MODEL: 3}
    assert threads[200].samples == {pp.IPC_STUB: 4}


def test_a_group_s_cpu_splits_by_its_threads_samples_and_the_interpreter_s_by_py_spy():
    # 1,000 inferences: the loop 200 µs each, the instance 300, the stub 100.
    measured = pp.Measured("stub:cnn_py", "http:1", inferences=1000)
    measured.by_thread = {"server main 10": 0.2, "server instance cnn_py 11": 0.3,
                          "stub main 20": 0.1}  # fmt: skip
    measured.perf.by_tid.update(
        {
            (10, pp.INTERPRETER): 3,
            (10, pp.KERNEL_NET): 1,
            (11, pp.MODEL): 4,
            (20, pp.INTERPRETER): 2,
        }
    )
    row = Row(measured, server_pid=1)
    loop_spy = pp.Profile(total=4)
    loop_spy.samples.update({pp.HTTP: 1, pp.CORE: 3})
    loop_spy.symbols.update(
        {(pp.HTTP, "py", "_read_now (sockets.py:243)"): 1, (pp.CORE, "py", "infer (dp.py:9)"): 3}
    )
    # py-spy saw the loop's thread (10) only: the stub's Python stays unresolved.
    row.pyspy_threads = {10: loop_spy}
    assert row.group_us() == pytest.approx({LOOP_THREAD: 200, INSTANCE_THREADS: 300, STUB: 100})
    steps = row.group_steps()
    loop = steps[LOOP_THREAD]
    assert loop["socket send/recv (kernel)"] == pytest.approx(50)
    assert loop["transport + parse (HTTP/1.1, HTTP/2)"] == pytest.approx(150 * 1 / 4)
    assert loop["core: data plane, batcher, request/response"] == pytest.approx(150 * 3 / 4)
    assert sum(loop.values()) == pytest.approx(200)
    assert steps[INSTANCE_THREADS]["model (model.py, onnxruntime)"] == pytest.approx(300)
    assert steps[STUB]["unresolved"] == pytest.approx(100)
    assert "instance thread: server instance cnn_py 11 300 (model execute 100%)" in row.threads()
    # The loop's 150 µs of Python by its lines; py-spy saw no Python in the stub.
    assert row.top_python(LOOP_THREAD, 5) == [
        pytest.approx((112.5, "core: data plane, batcher, request/response: infer (dp.py:9)")),
        pytest.approx((37.5, "transport + parse: _read_now (sockets.py:243)")),
    ]
    assert row.top_python(STUB, 5) == []


def test_the_repository_is_one_both_servers_read(tmp_path):
    onnx_file = tmp_path / "cnn.onnx"
    onnx_file.write_bytes(b"not parsed by the config reader")
    repository = write_repository(tmp_path / "inproc", onnx_file, "in_process", onnx=True)
    for name, mode in (("cnn_py", "onnxruntime"), ("cnn_null", "null")):
        config, _ = read_model_config(repository / name)
        assert config.backend == "python"
        assert config.max_batch_size == 16
        assert config.dynamic_batching.max_queue_delay_microseconds == 500
        assert config.parameters["CNN_MODE"].string_value == mode
        assert config.parameters["EXECUTION_MODE"].string_value == "in_process"
        assert (repository / name / "1" / "model.onnx").exists()
    config, _ = read_model_config(repository / "cnn_onnx")
    assert config.backend == "onnxruntime"
    assert config.parameters["intra_op_thread_count"].string_value == "1"
