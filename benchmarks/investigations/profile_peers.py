"""Both sides profiled: Triton's Python backend against trionserve, CPU per inference by component.

Usage:
    python -m benchmarks.investigations.profile_peers [--points http:1,http:16,grpc:1,grpc:16]
        [--servers triton,onnx,inproc,loop,stub] [--seconds 3] [--warmup 2] [--rounds 1]
        [--cache DIR] [--out DIR] [--perf /usr/bin/perf]

Starts Triton (nvidia-pytriton's tritonserver, as benchmarks.peers does: install
it first with ``python -m benchmarks.peers --peers triton --install-only``) on
the Python-backend `simple` (add_sub model.py, one instance), and trionserve
four times: ONNX `simple` (the example repository), the same model.py in-process
(``EXECUTION_MODE`` ``in_process``) on its instance's thread and on the event
loop (``INPROCESS_EXECUTE_ON`` ``event_loop``), and in a stub process. Each point
(protocol:concurrency) loads each server in turn with NVIDIA's perf_analyzer
(benchmarks/perf_analyzer.py finds it) and, while the load runs, measures three
windows of ``--seconds``:

1. clean: per-thread CPU (user and system, ``/proc/PID/task/TID/stat``) of the
   server and its stubs, and the inferences the server counted (its statistics
   extension): the CPU per inference, by thread;
2. ``perf record --call-graph`` (``fp``, or ``dwarf,8192`` for whole chains
   through code built without frame pointers) of the server's process tree:
   the share of CPU samples by component, read from the shared object and
   symbol of each sample (C/C++ symbols; the kernel's by the system call it
   serves);
3. trionserve only, twice as long: ``py-spy record --gil --subprocesses``: the
   share of the GIL holders' samples (the server's and each stub's) by
   component, read from the innermost frame that names one (trionserve's
   modules, h2, protobuf, Trio, the model). Without ``--native`` (whose
   sampling could not keep up on a loaded machine); the garbage collector's
   time comes from perf's samples in ``gc_collect_main``.

A component's CPU per inference is its share of the profile times the clean
window's CPU per inference (the profilers slow the servers; their shares are
used, never their rates). Triton's components come from perf alone; trionserve's
kernel and native-library components come from perf and the rest (the
interpreter's time) is split by py-spy's shares. Prints one Markdown table per
point and the per-thread CPU; ``--out DIR`` keeps the profiles and the
measurements, and ``--reanalyze DIR`` prints the tables from them again.
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import perf_analyzer
from benchmarks.matrix import (
    EXAMPLES,
    ROOT,
    default_cache,
    start_trionserve,
    tree_pids,
)
from benchmarks.peers.common import PeerUnavailable
from benchmarks.peers.triton import Triton, write_repository
from trionserve.testing import ServerProcess

_TICKS = os.sysconf("SC_CLK_TCK")
SERVERS = {
    "triton": "Triton, Python `simple`",
    "onnx": "ours, ONNX `simple`",
    "inproc": "ours, in-process `simple`",
    "loop": "ours, in-process on the event loop",
    "stub": "ours, stub `simple`",
}

# The components, in table order; both servers' samples are sorted into these.
HTTP = "HTTP transport + parse"
GRPC = "gRPC transport (HTTP/2)"
PROTOBUF = "protobuf"
HANDLER = "frontend handler (decode/encode)"
CORE = "core: data plane, scheduler, request/response"
EXECUTOR = "backend executor, thread hand-off"
IPC_SERVER = "Python backend IPC, server side"
IPC_STUB = "stub side: IPC, pb_utils objects"
MODEL = "model execute (model.py / ORT)"
LOOP = "event loop (Trio's runner)"
GC = "GC"
LIBC = "libc/libstdc++ (malloc, memcpy, locks)"
KERNEL_FUTEX = "kernel: futex, eventfd (thread wake-ups)"
KERNEL_POLL = "kernel: epoll/poll"
KERNEL_NET = "kernel: socket send/recv"
KERNEL_OTHER = "kernel: other (scheduler, IRQ, page faults, other syscalls)"
OTHER = "other / unresolved"
INTERPRETER = "interpreter"  # trionserve's Python: split by py-spy
COMPONENTS = [
    HTTP, GRPC, PROTOBUF, HANDLER, CORE, EXECUTOR, IPC_SERVER, IPC_STUB, MODEL, LOOP, GC,
    LIBC, KERNEL_FUTEX, KERNEL_POLL, KERNEL_NET, KERNEL_OTHER, OTHER,
]  # fmt: skip


# ------------------------------------------------------------------ /proc


def thread_times(pids: Iterable[int]) -> dict[tuple[int, int], tuple[str, str, int, int]]:
    """(pid, tid) -> (process name, thread name, user ticks, system ticks); the
    first of ``pids`` is the server, the others its stubs."""
    pids = list(pids)
    times = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                process = f.read().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            fields = stat[stat.rindex(b")") + 2 :].split()
            role = "server" if pid == pids[0] else "stub"
            name = f"{role} {'main' if int(tid) == pid else name} {tid}"
            times[(pid, int(tid))] = (process, name, int(fields[11]), int(fields[12]))
    return times


def inference_count(http_url: str, model: str = "simple") -> int:
    return perf_analyzer._inference_count(http_url, model)


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ------------------------------------------------------------------ perf: C/C++ symbols

# (pattern on the symbol, component), the first match wins; for every DSO but the kernel.
SYMBOLS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(
            r"google::protobuf|::_InternalSerialize|::_InternalParse|ByteSizeLong|"
            r"inference::\w+(Request|Response|Tensor|Parameter)"
        ),
        PROTOBUF,
    ),
    (
        re.compile(
            r"\bevhtp|\bhtparse|\bevhttp|\bevbuffer|\bbufferevent|\bevent_|\bev_|"
            r"\bevutil|\bepoll_dispatch|\bevmap|\bevthread"
        ),
        HTTP,
    ),
    (
        re.compile(
            r"HTTPAPIServer|HTTPServer|triton::server::\w*Http|EVBuffer|JsonParse|"
            r"TritonJson|rapidjson"
        ),
        HANDLER,
    ),
    (
        re.compile(
            r"triton::server::grpc|CommonHandler|InferHandler|ModelInferHandler|"
            r"ModelStreamInferHandler|InferResponseCompleteCommon"
        ),
        HANDLER,
    ),
    (
        re.compile(
            r"\bgrpc|gpr_|\babsl|\btsi_|chttp2|hpack|\bcq_|completion_queue|"
            r"grpc_core|grpc_event_engine|\bupb_|\bre2::|\bcensus"
        ),
        GRPC,
    ),
    (
        re.compile(
            r"boost::interprocess|MessageQueue|SharedMemoryManager|IPCMessage|"
            r"ipc_message|PbMemory|PbTensor::(Load|Save)|RequestExecutor|"
            r"bi::|interprocess"
        ),
        IPC_SERVER,
    ),
    (
        re.compile(
            r"triton::core|TRITONSERVER_|TRITONBACKEND_|InferenceRequest|"
            r"InferenceResponse|Scheduler|RateLimiter|TritonModel|Payload"
        ),
        CORE,
    ),
]
LIBC_DSOS = ("libc.so", "libc-", "libstdc++", "libm.so", "libgcc_s", "ld-linux", "libpthread")
FUTEX = ("futex", "eventfd", "do_wait_intr", "sem_post", "sem_wait", "Waiter::Poke",
         "pthread_cond", "lll_lock", "take_gil", "drop_gil")  # fmt: skip
POLL = ("epoll", "sys_poll", "do_poll", "do_select", "sys_select", "ppoll")
NET = ("sendmsg", "recvmsg", "sendto", "recvfrom", "tcp_", "unix_stream", "sock_", "inet_",
       "__sys_send", "__sys_recv", "skb", "ip_", "__x64_sys_write", "__x64_sys_read",
       "__x64_sys_writev", "__x64_sys_readv", "netif", "net_rx", "loopback", "__send",
       "__recv", "__libc_send", "__libc_recv", "libc_write", "writev", "readv")  # fmt: skip


def _kernel_component(chain: list[tuple[str, str]]) -> str:
    """A kernel sample's component: the system call (or path) its call chain passes,
    read from the kernel's frames and the two user-space frames that made the call
    (the kernel's own chain often stops at the system call entry)."""
    kernel = [sym for sym, dso in chain if dso.startswith("[kernel")]
    caller = [sym for sym, dso in chain if not dso.startswith("[kernel")][:2]
    names = " ".join(kernel + caller)
    for words, component in ((FUTEX, KERNEL_FUTEX), (POLL, KERNEL_POLL), (NET, KERNEL_NET)):
        if any(word in names for word in words):
            return component
    return KERNEL_OTHER


def _native_component(sym: str, dso: str) -> str | None:
    """A user-space C/C++ frame's component, or None where only its callers can tell."""
    base = os.path.basename(dso)
    if base.startswith("libpython"):
        return MODEL  # Triton's stub: model.py and pb_utils' Python
    if "triton_python_backend_stub" in base:
        return IPC_STUB
    if base.startswith("libtriton_python"):
        for pattern, component in SYMBOLS[:1]:
            if pattern.search(sym):
                return component
        return IPC_SERVER
    if "onnxruntime" in dso or "_multiarray" in base or "numpy" in dso:
        return MODEL
    if base.startswith(LIBC_DSOS):
        return None
    for pattern, component in SYMBOLS:
        if pattern.search(sym):
            return component
    if base.startswith("libtritonserver"):
        return CORE
    if base == "tritonserver":
        return OTHER
    return None


def _stub_calls_numpy(user: list[tuple[str, str]]) -> bool:
    """Whether numpy's C code (or libc's under it) was called by Triton's stub
    binary itself, not by model.py through the interpreter: pb_utils' own work,
    such as ``as_numpy`` copying a tensor out of shared memory
    (``pybind11::array``'s constructor). Needs a whole chain (``--call-graph
    dwarf``)."""
    seen_numpy = False
    for _, dso in user:
        base = os.path.basename(dso)
        if "_multiarray" in base or "numpy" in dso:
            seen_numpy = True
        elif not base.startswith(LIBC_DSOS):
            return seen_numpy and "triton_python_backend_stub" in base
    return False


@dataclass
class Profile:
    """Samples by component (perf: all; py-spy: the interpreter's), with the top symbols."""

    samples: collections.Counter = field(default_factory=collections.Counter)
    symbols: collections.Counter = field(default_factory=collections.Counter)
    by_tid: collections.Counter = field(default_factory=collections.Counter)
    total: int = 0

    def share(self, component: str) -> float:
        return self.samples[component] / self.total if self.total else 0.0


_PERF_HEAD = re.compile(r"^(\S.*?)\s+(\d+)\s*$")
_PERF_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)$")


def read_perf_script(text: str, interpreted: bool) -> Profile:
    """perf script output -> samples by component. A kernel sample is sorted by the
    system call its chain passes; a user-space one by the first frame, from the
    leaf up, that names a component (a libc frame such as malloc, memcpy or a lock
    goes to its caller), else libc or "other". ``interpreted`` (trionserve and its
    stubs): every user-space sample but ONNX Runtime's and the garbage collector's
    is the interpreter's, to be split by py-spy."""
    profile = Profile()
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        head = _PERF_HEAD.match(lines[0]) if lines else None
        if head is None:
            continue
        chain: list[tuple[str, str]] = []
        for line in lines[1:]:
            frame = _PERF_FRAME.match(line)
            if frame:
                sym = re.sub(r"\+0x[0-9a-f]+$", "", frame.group(1))
                chain.append((sym, frame.group(2)))
        if not chain:
            continue
        profile.total += 1
        sym, dso = chain[0]
        user = [(s, d) for s, d in chain if not d.startswith("[kernel")]
        if dso.startswith("[kernel"):
            component = _kernel_component(chain)
        elif interpreted and any("gc_collect" in s for s, _ in user):
            component = GC  # the collector's C frames: exact here, invisible to py-spy
        elif interpreted:
            component = MODEL if "onnxruntime" in dso else INTERPRETER
        elif _stub_calls_numpy(user):
            component = IPC_STUB
        else:
            found = (_native_component(s, d) for s, d in user)
            component = next((c for c in found if c is not None), None) or (
                LIBC if os.path.basename(dso).startswith(LIBC_DSOS) else OTHER
            )
        profile.samples[component] += 1
        profile.symbols[(component, os.path.basename(dso), sym[:90])] += 1
        profile.by_tid[(int(head.group(2)), component)] += 1
    return profile


# ------------------------------------------------------------------ py-spy: Python frames

# The per-call path's modules, used by the server and the stub alike.
_LANE = "lane"
_STUB_FRAME = re.compile(r"python/stub\.py")

# (pattern on "function (file)", component): the innermost frame that matches decides.
FRAMES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\((gc|<gc>)\)|gc_collect|collect_generation|\bgc_collect_main"), GC),
    (re.compile(r"model\.py"), MODEL),
    (re.compile(r"onnxruntime|backends/onnxruntime\.py"), MODEL),
    (
        re.compile(r"stubpath/|python/stub\.py|python/runtime\.py|python/inprocess_runtime\.py"),
        IPC_STUB,
    ),
    (re.compile(r"_pb2|google/protobuf|_generated/|protopool"), PROTOBUF),
    (
        re.compile(
            r"\bh2/|hpack/|hyperframe/|protocol/grpc/(connection|flow|framing|streams|"
            r"transport|state)\.py"
        ),
        GRPC,
    ),
    (re.compile(r"protocol/grpc/"), HANDLER),
    (re.compile(r"httptools|protocol/http/(h1|transport|state)\.py|protocol/listeners"), HTTP),
    (re.compile(r"protocol/http/"), HANDLER),
    (
        re.compile(
            r"backends/python/(instance|wire|messages|shm|process|delivery|control|"
            r"backend|bls)\.py"
        ),
        IPC_SERVER,
    ),
    # The lane's code runs on both sides: the stub's when a stub's frame is
    # below it (see _frame_component).
    (re.compile(r"backends/python/(lane|lane_calls|calls)\.py"), _LANE),
    (
        re.compile(
            r"backends/python/inprocess\.py|backends/(base|manager)\.py|workers/|"
            r"actors/(executor|instance_thread)\.py|threading\.py|trio/_threads|"
            r"to_thread|queue\.py"
        ),
        EXECUTOR,
    ),
    (
        re.compile(
            r"trionserve/(dataplane|drain|server)\.py|trionserve/(schedulers|core|"
            r"observability|repository|actors)/|trionserve/backends/"
        ),
        CORE,
    ),
    # Trio's own frames count for the loop only where no frame above names a
    # component: the runner between tasks, not a task's checkpoints and sockets.
    (re.compile(r"\btrio/|outcome/|sniffio/"), LOOP),
]


_PROTOBUF_CALLS = re.compile(
    r"\b(FromString|ParseFromString|SerializeToString|MergeFrom|CopyFrom)\("
)
_FRAME_LINE = re.compile(r"\((trionserve/[^:()]+\.py):(\d+)\)$")


def _calls_protobuf(frame: str) -> bool:
    """Whether a trionserve frame's current line parses or serializes a protobuf
    message (the C extension's time shows as that Python line)."""
    where = _FRAME_LINE.search(frame)
    if where is None:
        return False
    line = linecache.getline(str(ROOT / where.group(1)), int(where.group(2)))
    return bool(_PROTOBUF_CALLS.search(line))


def _frame_component(frames: list[str]) -> str:
    """The component of the innermost frame that names one, the event loop's only
    where nothing else is named; protobuf's where the innermost frame is a line
    that parses or serializes a message; the lane's (:mod:`.lane`, the calls on
    it) the stub's IPC in a stub's stack, the server's otherwise."""
    if frames and _calls_protobuf(frames[-1]):
        return PROTOBUF
    loop = False
    for frame in reversed(frames):
        for pattern, component in FRAMES:
            if pattern.search(frame):
                if component == _LANE:
                    stub = any(_STUB_FRAME.search(outer) for outer in frames)
                    return IPC_STUB if stub else IPC_SERVER
                if component != LOOP:
                    return component
                loop = True
    return LOOP if loop else OTHER


def read_pyspy_raw(text: str) -> Profile:
    """py-spy's raw (collapsed) output -> samples by component (with ``--gil``:
    the threads holding their process's GIL, server and stubs alike)."""
    profile = Profile()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        n = int(count)
        component = _frame_component(frames)
        profile.total += n
        profile.samples[component] += n
        profile.symbols[(component, "py", frames[-1][:90])] += n
    return profile


# ------------------------------------------------------------------ the run


@dataclass
class Measured:
    """One server at one point."""

    server: str
    point: str
    inferences: int = 0
    seconds: float = 0.0
    user: float = 0.0
    system: float = 0.0
    by_thread: dict[str, float] = field(default_factory=dict)  # CPU s
    by_process: dict[str, float] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)
    perf: Profile = field(default_factory=Profile)
    pyspy: Profile = field(default_factory=Profile)
    profiled_us: float = float("nan")  # CPU per inference while perf recorded
    error: str = ""
    stem: str = ""  # the profiles' file names, without .perf.txt / .pyspy.txt

    RAW = ("server", "point", "stem", "inferences", "seconds", "user", "system", "by_thread",
           "by_process", "load", "profiled_us", "error")  # fmt: skip

    def raw(self) -> dict:
        """What /proc and the statistics gave, for --reanalyze."""
        return {name: getattr(self, name) for name in self.RAW}

    @classmethod
    def from_raw(cls, raw: dict, folder: Path) -> Measured:
        """A measurement kept by --out, its profiles read again from ``folder``."""
        result = cls(**{name: raw[name] for name in cls.RAW})
        perf_text = folder / f"{result.stem}.perf.txt"
        if perf_text.exists():
            interpreted = not result.server.startswith("triton")
            result.perf = read_perf_script(perf_text.read_text(), interpreted)
        pyspy_raw = folder / f"{result.stem}.pyspy.txt"
        if pyspy_raw.exists():
            result.pyspy = read_pyspy_raw(pyspy_raw.read_text())
        return result

    @property
    def cpu_us(self) -> float:
        return 1e6 * (self.user + self.system) / self.inferences if self.inferences else 0.0

    def components(self) -> dict[str, float]:
        """us per inference by component: perf's shares of the clean CPU, the
        interpreter's part split by py-spy's shares."""
        out: dict[str, float] = collections.defaultdict(float)
        total = self.cpu_us
        python_share = self.perf.share(INTERPRETER)
        for component in COMPONENTS:
            out[component] += self.perf.share(component) * total
        if python_share:
            if self.pyspy.total:
                for component in COMPONENTS:
                    out[component] += python_share * self.pyspy.share(component) * total
            else:
                out[OTHER] += python_share * total
        return out


class Loader:
    """perf_analyzer at one point, run until stopped."""

    def __init__(
        self, command: list[str], url: str, protocol: str, concurrency: int, model: str = "simple"
    ) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="profile-pa-", suffix=".log")
        argv = [
            *command, "-m", model, "-i", protocol, "-u", url,
            "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", "600000", "--max-trials", "1",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> str:
        """Stop it; its output when it had ended early (an error), else ""."""
        ended = self.process.poll() is not None
        if not ended:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        return output[-600:] if ended else ""


def measure(
    label: str,
    pid: int,
    http_url: str,
    seconds: float,
    perf: str | None,
    py_spy: str | None,
    keep: Path | None,
    point: str,
    call_graph: str = "fp",
    model: str = "simple",
) -> Measured:
    """One server under load: the clean window, then perf's, then py-spy's (the
    label of a Triton starts with "triton": its samples are all native)."""
    result = Measured(label, point)
    pids = tree_pids(pid)
    result.load.append(load_average())
    before, count = thread_times(pids), inference_count(http_url, model)
    started = time.monotonic()
    time.sleep(seconds)
    after, counted = thread_times(tree_pids(pid)), inference_count(http_url, model)
    result.seconds = time.monotonic() - started
    result.inferences = counted - count
    for key, (process, thread, user, system) in after.items():
        user0, system0 = before.get(key, (process, thread, 0, 0))[2:]
        du, ds = (user - user0) / _TICKS, (system - system0) / _TICKS
        result.user += du
        result.system += ds
        result.by_thread[thread] = result.by_thread.get(thread, 0.0) + du + ds
        result.by_process[process] = result.by_process.get(process, 0.0) + du + ds
    result.load.append(load_average())
    with tempfile.TemporaryDirectory() as tmp:
        folder = keep or Path(tmp)
        stem = f"{label}-{point.replace(':', '-c')}"
        result.stem = stem
        if perf:
            data = folder / f"{stem}.perf.data"
            pids = tree_pids(pid)
            count = inference_count(http_url, model)
            cpu0 = sum(u + s for *_, u, s in thread_times(pids).values())
            subprocess.run(
                [perf, "record", "-q", "--call-graph", call_graph, "-F", "997", "-o", str(data),
                 "-p", ",".join(map(str, pids)), "--", "sleep", str(seconds)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
            )  # fmt: skip
            cpu1 = sum(u + s for *_, u, s in thread_times(pids).values())
            counted = inference_count(http_url, model) - count
            if counted:
                result.profiled_us = 1e6 * (cpu1 - cpu0) / _TICKS / counted
            script = subprocess.run(
                [perf, "script", "--no-inline", "-i", str(data), "-F", "comm,tid,ip,sym,dso"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if keep:
                (folder / f"{stem}.perf.txt").write_text(script.stdout)
            result.perf = read_perf_script(
                script.stdout, interpreted=not label.startswith("triton")
            )
        if py_spy:
            raw = folder / f"{stem}.pyspy.txt"
            subprocess.run(
                [py_spy, "record", "--pid", str(pid), "--subprocesses", "--threads",
                 "--gil", "--nonblocking", "--rate", "250",
                 "--duration", str(int(round(2 * seconds))),
                 "--format", "raw", "--output", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
            )  # fmt: skip
            if raw.exists():
                result.pyspy = read_pyspy_raw(raw.read_text())
    result.load.append(load_average())
    return result


def start_servers(names: list[str], cache: Path, tmp: Path, log: Callable[[str], None]):
    """name -> (process, pid, HTTP URL, gRPC URL) for each server that started."""
    servers: dict[str, tuple[ServerProcess, int, str, str]] = {}
    for name in names:
        if name == "triton":
            peer = Triton(cache / "peers", 900.0)
            try:
                peer.install(log=log)
                workdir = tmp / "triton"
                workdir.mkdir()
                running = peer.start(workdir, 180.0)
            except PeerUnavailable as exc:
                log(f"[triton] skipped: {exc}")
                continue
            target = running.target
            servers[name] = (
                running.process,
                target.pid,
                str(target.http_url),
                str(target.grpc_url),
            )
            continue
        if name == "onnx":
            repository = EXAMPLES
        elif name == "stub":
            repository = write_repository(tmp / name)
        else:
            execute_on = "event_loop" if name == "loop" else ""
            repository = write_repository(tmp / name, "in_process", execute_on)
        process, target = start_trionserve(name, repository=repository)
        servers[name] = (process, target.pid, str(target.http_url), str(target.grpc_url))
    return servers


def format_tables(
    results: list[Measured], servers: list[str], labels: dict[str, str] | None = None
) -> str:
    """One table per point: components by server (``labels``: each server's column
    head, SERVERS' by default), then the threads."""
    labels = labels or SERVERS
    out = []
    points = list(dict.fromkeys(r.point for r in results))
    for point in points:
        row = {r.server: r for r in results if r.point == point}
        present = [s for s in servers if s in row]
        loads = [x for s in present for x in row[s].load]
        out.append(
            f"\n#### {point.replace(':', ' c=')} (µs of CPU per inference; load average "
            f"{min(loads):.1f}-{max(loads):.1f})\n"
        )
        out.append("| component | " + " | ".join(labels[s] for s in present) + " |")
        out.append("|---|" + "---:|" * len(present))
        parts = {s: row[s].components() for s in present}
        for component in COMPONENTS:
            if all(parts[s][component] < 0.5 for s in present):
                continue
            cells = " | ".join(f"{parts[s][component]:.0f}" for s in present)
            out.append(f"| {component} | {cells} |")
        out.append(
            "| **total (clean window)** | "
            + " | ".join(f"**{row[s].cpu_us:.0f}**" for s in present)
            + " |"
        )
        out.append(
            "| of which kernel (/proc) | "
            + " | ".join(f"{1e6 * row[s].system / max(row[s].inferences, 1):.0f}" for s in present)
            + " |"
        )
        out.append(
            "| infer/s (clean window) | "
            + " | ".join(f"{row[s].inferences / row[s].seconds:.0f}" for s in present)
            + " |"
        )
        out.append(
            "| CPU µs/inf while perf recorded | "
            + " | ".join(f"{row[s].profiled_us:.0f}" for s in present)
            + " |"
        )
        out.append("\nBy thread (µs per inference, clean window; what perf saw it do):\n")
        for s in present:
            out.append(f"- {labels[s]}: {_threads(row[s])}")
    return "\n".join(out)


def _threads(r: Measured) -> str:
    """The threads that used at least 2 µs per inference, each with the components
    of its perf samples (those of 15% or more)."""
    listed = []
    for name, cpu in sorted(r.by_thread.items(), key=lambda kv: -kv[1]):
        us = 1e6 * cpu / max(r.inferences, 1)
        if us < 2:
            continue
        role, rest = name.split(" ", 1)  # the thread's name may hold spaces
        thread, tid = rest.rsplit(" ", 1)
        mine = {c: n for (t, c), n in r.perf.by_tid.items() if t == int(tid)}
        total = sum(mine.values())
        parts = ", ".join(
            f"{c.split(' (')[0]} {n / total:.0%}"
            for c, n in sorted(mine.items(), key=lambda kv: -kv[1])
            if n >= 0.15 * total
        )
        listed.append(f"{role} {thread} {us:.0f}" + (f" ({parts})" if parts else ""))
    return "; ".join(listed)


def format_symbols(results: list[Measured], top: int) -> str:
    out = []
    for r in results:
        both: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for (component, dso, sym), n in r.perf.symbols.items():
            if component == INTERPRETER:
                continue  # py-spy's frames stand for these
            both[(component, dso, sym)] += n * 1_000_000 // max(r.perf.total, 1)
        python_share = r.perf.share(INTERPRETER)
        for (component, dso, sym), n in r.pyspy.symbols.items():
            both[(component, dso, sym)] += int(1_000_000 * python_share * n / max(r.pyspy.total, 1))
        out.append(f"\n{r.server} {r.point}: top {top} leaves (share of CPU)")
        for (component, dso, sym), ppm in both.most_common(top):
            out.append(f"  {ppm / 10_000:5.1f}%  {component:<28.28} {dso:<24.24} {sym}")
    return "\n".join(out)


def points_and_tools(args: argparse.Namespace) -> tuple[list[str], str | None, list[str]]:
    """``--points`` checked, py-spy (None with ``--no-py-spy``) and perf_analyzer's
    command, or SystemExit saying what is missing (this module's and
    profile_peers_cnn's command lines)."""
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    if not all(re.fullmatch(r"(http|grpc):\d+", p) for p in points):
        raise SystemExit("--points: protocol:concurrency, e.g. http:1,grpc:16")
    py_spy = None
    if not args.no_py_spy:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(py_spy).exists():
            raise SystemExit("py-spy is not installed (pip install py-spy), or --no-py-spy")
    try:
        command = perf_analyzer.resolve(args.perf_analyzer, args.cache)
    except perf_analyzer.Unavailable as exc:
        raise SystemExit(f"perf_analyzer cannot run here: {exc}") from None
    return points, py_spy, command


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", default="http:1,http:16,grpc:1,grpc:16")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--seconds", type=float, default=3.0, help="each window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="points repeated, order rotated")
    parser.add_argument("--cache", type=Path, default=default_cache())
    parser.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: PyPI's)")
    parser.add_argument("--perf", default=shutil.which("perf"), help="perf (none: no profile)")
    parser.add_argument(
        "--call-graph", default="fp", help="perf's --call-graph: fp, or dwarf,8192 (slower)"
    )
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument(
        "--out", type=Path, help="keep the profiles and the measurements here (--reanalyze)"
    )
    parser.add_argument("--top", type=int, default=25, help="symbols listed per profile")
    parser.add_argument(
        "--reanalyze",
        type=Path,
        metavar="DIR",
        help="print the tables again from what --out DIR kept (no servers, no load)",
    )
    args = parser.parse_args()
    if args.reanalyze:
        kept = json.loads((args.reanalyze / "measurements.json").read_text())
        again = _merge([Measured.from_raw(raw, args.reanalyze) for raw in kept])
        names = list(dict.fromkeys(r.server for r in again))
        print(format_tables(again, names))
        print(format_symbols(again, args.top))
        return
    # SIGTERM stops the servers and the load, as ^C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in names if s not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}; known: {', '.join(SERVERS)}")
    points, py_spy, command = points_and_tools(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)

    results: list[Measured] = []
    with tempfile.TemporaryDirectory(prefix="profile-peers-") as tmp:
        servers = start_servers(names, args.cache, Path(tmp), log=print)
        try:
            order = [n for n in names if n in servers]
            for round_index in range(args.rounds):
                for point in points:
                    protocol, concurrency = point.split(":")
                    shift = round_index % len(order)
                    for name in order[shift:] + order[:shift]:
                        _, pid, http_url, grpc_url = servers[name]
                        url = http_url if protocol == "http" else grpc_url
                        loader = Loader(command, url, protocol, int(concurrency))
                        try:
                            time.sleep(args.warmup)
                            result = measure(
                                name, pid, http_url, args.seconds, args.perf,
                                None if name == "triton" else py_spy,
                                args.out, f"{point}-r{round_index}" if args.rounds > 1 else point,
                                args.call_graph,
                            )  # fmt: skip
                        finally:
                            error = loader.stop()
                        result.point = point
                        result.error = error
                        results.append(result)
                        print(
                            f"{point:<8} {name:<7} {result.cpu_us:6.0f} µs/inf "
                            f"({result.inferences / result.seconds:5.0f} infer/s, "
                            f"load {result.load[0]:.1f}) {error[-200:]}",
                            flush=True,
                        )
        finally:
            for process, *_ in servers.values():
                process.stop()
    if args.out:
        raw = [r.raw() for r in results]
        (args.out / "measurements.json").write_text(json.dumps(raw, indent=1))
    merged = _merge(results)
    print(format_tables(merged, names))
    print(format_symbols(merged, args.top))


def _merge(results: list[Measured]) -> list[Measured]:
    """Rounds of the same server and point summed into one."""
    merged: dict[tuple[str, str], Measured] = {}
    for r in results:
        m = merged.setdefault((r.server, r.point), Measured(r.server, r.point))
        m.inferences += r.inferences
        m.seconds += r.seconds
        m.user += r.user
        m.system += r.system
        m.load += r.load
        for target, source in ((m.by_thread, r.by_thread), (m.by_process, r.by_process)):
            for k, v in source.items():
                target[k] = target.get(k, 0.0) + v
        for mine, theirs in ((m.perf, r.perf), (m.pyspy, r.pyspy)):
            mine.samples.update(theirs.samples)
            mine.symbols.update(theirs.symbols)
            mine.by_tid.update(theirs.by_tid)
            mine.total += theirs.total
        if r.profiled_us == r.profiled_us:
            m.profiled_us = r.profiled_us  # the last round's
        m.error = m.error or r.error
    return list(merged.values())


if __name__ == "__main__":
    main()
