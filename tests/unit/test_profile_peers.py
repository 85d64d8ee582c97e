"""benchmarks/investigations/profile_peers.py: perf and py-spy samples sorted into components,
and the components' CPU per inference."""

from __future__ import annotations

import pytest

from benchmarks.investigations.profile_peers import (
    CORE,
    GC,
    HANDLER,
    HTTP,
    INTERPRETER,
    IPC_SERVER,
    IPC_STUB,
    KERNEL_FUTEX,
    KERNEL_NET,
    KERNEL_OTHER,
    LIBC,
    LOOP,
    MODEL,
    PROTOBUF,
    Measured,
    Profile,
    read_perf_script,
    read_pyspy_raw,
)
from tests.serverproc import ROOT

SERVER = "/opt/tritonserver/bin/tritonserver"
BACKEND = "/opt/tritonserver/backends/python/libtriton_python.so"
LIBC_SO = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBPYTHON = "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"


def _sample(comm: str, tid: int, *frames: tuple[str, str]) -> str:
    """One sample as ``perf script -F comm,tid,ip,sym,dso`` prints it, leaf first."""
    lines = [f"{comm} {tid} "]
    lines += [f"\t    7f00deadbeef {sym}+0x1a ({dso})" for sym, dso in frames]
    return "\n".join(lines) + "\n"


def _perf(*samples: str) -> str:
    return "\n".join(samples)


def test_kernel_samples_go_by_the_system_call_or_its_caller():
    text = _perf(
        _sample(
            "tritonserver", 11,
            ("finish_task_switch.isra.0", "[kernel.kallsyms]"),
            ("__x64_sys_futex", "[kernel.kallsyms]"),
            ("syscall", LIBC_SO),
        ),
        # The kernel's chain stops at the entry: the libc caller names the call.
        _sample(
            "triton_python_b", 12,
            ("_raw_spin_unlock_irqrestore", "[kernel.kallsyms]"),
            ("entry_SYSCALL_64_after_hwframe", "[kernel.kallsyms]"),
            ("sem_post@GLIBC_2.2.5", LIBC_SO),
        ),
        _sample(
            "tritonserver", 11,
            ("tcp_sendmsg_locked", "[kernel.kallsyms]"),
            ("__libc_sendmsg", LIBC_SO),
        ),
        _sample("tritonserver", 13, ("asm_sysvec_apic_timer_interrupt", "[kernel.kallsyms]")),
    )  # fmt: skip
    profile = read_perf_script(text, interpreted=False)
    assert profile.total == 4
    assert profile.samples == {KERNEL_FUTEX: 2, KERNEL_NET: 1, KERNEL_OTHER: 1}
    assert profile.by_tid[(11, KERNEL_FUTEX)] == 1 and profile.by_tid[(12, KERNEL_FUTEX)] == 1


def test_a_libc_frame_counts_for_its_first_caller_that_names_a_component():
    text = _perf(
        _sample(
            "tritonserver", 11,
            ("malloc", LIBC_SO),
            ("evhtp_request_new", SERVER),
        ),
        _sample(
            "tritonserver", 11,
            ("__memmove_avx512_unaligned_erms", LIBC_SO),
            ("triton::backend::python::ModelInstanceState::ProcessRequests", BACKEND),
        ),
        _sample(
            "tritonserver", 11,
            ("std::_Hash_bytes", "/usr/lib/libstdc++.so.6"),
            ("triton::core::InferenceRequest::Run", "/opt/lib/libtritonserver.so"),
        ),
        _sample("tritonserver", 11, ("free", LIBC_SO)),  # no caller: libc's own
        _sample("triton_python_b", 12, ("_PyEval_EvalFrameDefault", LIBPYTHON)),
    )  # fmt: skip
    profile = read_perf_script(text, interpreted=False)
    assert profile.samples == {HTTP: 1, IPC_SERVER: 1, CORE: 1, LIBC: 1, MODEL: 1}


def test_an_interpreter_s_user_space_is_left_for_py_spy_but_gc_and_onnxruntime():
    text = _perf(
        _sample("python", 20, ("_PyEval_EvalFrameDefault", LIBPYTHON), ("main", "python3.11")),
        _sample(
            "python", 20,
            ("visit_decref", LIBPYTHON),
            ("gc_collect_main", LIBPYTHON),
            ("_PyObject_GC_New", LIBPYTHON),
        ),
        _sample("python", 21, ("MlasGemm", "/venv/onnxruntime/capi/onnxruntime_pybind11_state.so")),
        _sample("python", 20, ("do_epoll_wait", "[kernel.kallsyms]"), ("epoll_wait", LIBC_SO)),
    )  # fmt: skip
    profile = read_perf_script(text, interpreted=True)
    assert profile.samples[INTERPRETER] == 1
    assert profile.samples[GC] == 1
    assert profile.samples[MODEL] == 1
    assert profile.total == 4


def _frame(function: str, path: str, line: int = 1) -> str:
    return f"{function} ({path}:{line})"


def test_py_spy_frames_go_to_the_innermost_named_component_trio_only_outside_tasks():
    runner = [_frame("run", "trio/_core/_run.py"), _frame("unrolled_run", "trio/_core/_run.py")]
    transport = _frame("_Connection.respond", "trionserve/protocol/http/transport.py")
    send = _frame("SocketStream.send_all", "trio/_highlevel_socket.py")
    stacks = [
        # A Trio socket call made by the HTTP transport is the transport's.
        ";".join(["process 1:\"python\"", "thread (0x1)", *runner, transport, send]) + " 3",
        # Trio's runner with no task above it is the event loop's.
        ";".join(["thread (0x1)", *runner]) + " 2",
        ";".join(
            [*runner, _frame("execute", "/tmp/models/simple/1/model.py", 30)]
        ) + " 1",
    ]  # fmt: skip
    profile = read_pyspy_raw("\n".join(stacks))
    assert profile.samples == {HTTP: 3, LOOP: 2, MODEL: 1}
    assert profile.total == 6


def test_the_lanes_frames_are_the_stubs_ipc_in_a_stub_and_the_servers_otherwise():
    post = _frame("Lane.post", "trionserve/backends/python/lane.py", 163)
    pump = _frame("LaneCalls._pump", "trionserve/backends/python/lane_calls.py", 170)
    stub = _frame("StubRuntime._reply", "trionserve/backends/python/stub.py", 294)
    # The server's loop posting an execute and reading replies, under the data
    # plane (whose frame would make it the core's), and the stub replying.
    core = _frame("DataPlane.infer", "trionserve/dataplane.py", 484)
    stacks = [";".join([core, pump, post]) + " 3", ";".join([core, pump]) + " 2",
              ";".join([stub, post]) + " 4"]  # fmt: skip
    profile = read_pyspy_raw("\n".join(stacks))
    assert profile.samples == {IPC_SERVER: 5, IPC_STUB: 4}


def test_a_line_that_parses_a_protobuf_message_is_protobuf_s():
    codec = "trionserve/protocol/grpc/codec.py"
    lines = (ROOT / codec).read_text().splitlines()
    parse = next(i for i, line in enumerate(lines, 1) if "FromString(" in line)
    other = next(i for i, line in enumerate(lines, 1) if line.startswith("def "))
    stacks = [
        _frame("parse_message", codec, parse) + " 4",
        _frame("something", codec, other) + " 1",
    ]
    profile = read_pyspy_raw("\n".join(stacks))
    assert profile.samples == {PROTOBUF: 4, HANDLER: 1}


def test_components_split_the_clean_cpu_by_perf_then_the_interpreter_by_py_spy():
    perf = Profile(total=10)
    perf.samples.update({INTERPRETER: 5, KERNEL_NET: 3, MODEL: 2})
    pyspy = Profile(total=4)
    pyspy.samples.update({HTTP: 3, LOOP: 1})
    # 2,000 inferences for 0.4 CPU s: 200 µs each.
    measured = Measured("onnx", "http:1", inferences=2000, user=0.3, system=0.1)
    measured.perf, measured.pyspy = perf, pyspy
    parts = measured.components()
    assert measured.cpu_us == pytest.approx(200)
    assert parts[KERNEL_NET] == pytest.approx(60)
    assert parts[MODEL] == pytest.approx(40)
    assert parts[HTTP] == pytest.approx(75)  # 200 x 0.5 x 3/4
    assert parts[LOOP] == pytest.approx(25)
    assert sum(parts.values()) == pytest.approx(200)


def test_numpy_called_by_triton_s_stub_itself_is_pb_utils_work_not_the_model_s():
    numpy_so = "/venv/numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so"
    stub_binary = "/opt/tritonserver/backends/python/triton_python_backend_stub"
    text = _perf(
        # as_numpy: pybind11's array constructor copies the input out of shared memory.
        _sample(
            "triton_python_b", 12,
            ("__memmove_avx512_unaligned_erms", LIBC_SO),
            ("_contig_to_contig", numpy_so),
            ("PyArray_NewCopy", numpy_so),
            ("pybind11::array::array", stub_binary),
        ),
        # model.py calling numpy through the interpreter stays the model's.
        _sample(
            "triton_python_b", 12,
            ("_contig_to_contig", numpy_so),
            ("_PyEval_EvalFrameDefault", LIBPYTHON),
            ("pybind11::cpp_function::dispatcher", stub_binary),
        ),
    )  # fmt: skip
    profile = read_perf_script(text, interpreted=False)
    assert profile.samples == {IPC_STUB: 1, MODEL: 1}
