"""Both sides for a 602 KB request: Triton 2.51 beside trionserve, CPU per inference
by thread group and by step, and the same model run directly.

Usage:
    python -m benchmarks.investigations.profile_peers_cnn [--points http:1,http:8,grpc:1,grpc:8]
        [--rows triton:cnn_py,triton:cnn_null,stub:cnn_py,stub:cnn_null,onnx:cnn_onnx,...]
        [--seconds 3] [--warmup 2] [--rounds 1] [--out DIR] [--reanalyze DIR [DIR ...]]
        [--call-graph fp] [--triton-call-graph dwarf,16384]

The request is benchmarks.served_vs_direct's: the small CNN's FP32 [1,3,224,224]
(602 KB) in, FP32 [1,1000] out, one instance, ``max_batch_size`` 16 and
``dynamic_batching`` with a 500 us delay. Triton (nvidia-pytriton's
``tritonserver``, as benchmarks.peers starts it; onnxruntime is added to its own
environment) has only the Python backend here, so the same ``model.py`` is served
on both servers:

- ``cnn_py``: model.py runs the CNN's ONNX file with onnxruntime (one intra-op
  thread, idle threads sleeping, as the ONNX Runtime backend and ``direct`` run it;
  a batch's inputs concatenated, its output split per request);
- ``cnn_null``: the same tensors, model.py reads each input and answers zeros
  [N,1000]: the model costs next to nothing and the server's work is what remains;
- ``cnn_onnx`` (trionserve only): the ONNX file on the ONNX Runtime backend.

Servers (one process each, serving all of its models): ``triton``; trionserve with
the model.py in a stub process (``stub``), in process on its instance's thread
(``inproc``) and on the event loop (``loop``); ``onnx`` is trionserve's stub server
with ``cnn_onnx``. A row is ``server:model``. Each point (protocol:concurrency,
perf_analyzer 2.60 at ``--concurrency-range C:C``, HTTP with binary tensors or gRPC)
loads each row in turn (rotated each round) and measures as
benchmarks.investigations.profile_peers does: a clean window of per-thread CPU from
``/proc`` and the server's inference count, then ``perf record`` of the process
tree (Triton's with DWARF call chains, so that a libc ``memcpy`` counts for the
code that called it), then (trionserve) ``py-spy --gil --subprocesses``. Before each point's rows,
``direct`` runs the ONNX file in this process with onnxruntime at batch 1, and after
them at each batch the ``cnn_py``/``cnn_onnx`` rows formed (their statistics).

Printed per point: CPU per inference by thread group with infer/s, mean batch and
direct / served; then per row the thread groups by step (perf's samples of the
group's threads; the interpreter's part of trionserve's split by py-spy's samples
of the same threads, which py-spy names by their OS thread id). The groups:

- Triton: ``frontend`` (its HTTP server's libevhtp threads and gRPC's completion
  queue and library threads: receive, parse, the request's creation, the answer's
  encoding and write), ``core`` (the dynamic batcher and the request/response
  life cycle), ``backend thread`` (the model instance's thread: the Python
  backend's server side, inputs into shared memory, the stub's wake-up and wait),
  each thread sorted by the components of its own perf samples (names cannot
  tell: nearly all of Triton's threads are called ``tritonserver``); ``stub``
  (the ``triton_python_backend_stub`` process: model.py, pb_utils, its IPC).
- trionserve: ``event loop`` (the main thread: HTTP/gRPC, decode, the data plane,
  the batcher, answers the loop writes), ``instance thread`` (the threads named
  ``instance <model>``: model.py in process, ONNX Runtime's call, the answers the
  thread writes), ``other`` (Trio's worker threads and the rest), ``stub`` (the
  stub process).

Each row's threads are listed after its table with their group, CPU per inference
and the components of their perf samples: the groups can be checked by hand.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.investigations import profile_peers as pp
from benchmarks.matrix import default_cache, start_trionserve
from benchmarks.peers.common import PeerUnavailable
from benchmarks.peers.triton import Triton
from benchmarks.served_vs_direct import (
    ModelSpec,
    _config,
    direct_runner,
    model_stats,
    run_direct,
    stats_delta,
    write_cnn_onnx,
)

DELAY_US = 500
MAX_BATCH = 16
SERVERS = ("triton", "stub", "inproc", "loop", "onnx")
DEFAULT_ROWS = (
    "triton:cnn_py,triton:cnn_null,stub:cnn_py,stub:cnn_null,onnx:cnn_onnx,"
    "inproc:cnn_py,inproc:cnn_null,loop:cnn_null"
)
PY_MODELS = ("cnn_py", "cnn_null")

# Thread groups, in table order.
FRONTEND = "frontend"
CORE_THREADS = "core"
BACKEND_THREAD = "backend thread"
LOOP_THREAD = "event loop"
INSTANCE_THREADS = "instance thread"
STUB = "stub"
OTHER_THREADS = "other"
GROUPS = [FRONTEND, CORE_THREADS, BACKEND_THREAD, LOOP_THREAD, INSTANCE_THREADS, STUB,
          OTHER_THREADS]  # fmt: skip

# Steps: the components of profile_peers, gathered. What the kernel does for a
# thread (its socket copies, its polls, its wake-ups) is a step of its own.
STEPS: dict[str, tuple[str, ...]] = {
    "socket send/recv (kernel)": (pp.KERNEL_NET,),
    "epoll/poll (kernel)": (pp.KERNEL_POLL,),
    "transport + parse (HTTP/1.1, HTTP/2)": (pp.HTTP, pp.GRPC),
    "decode / encode (handler, protobuf)": (pp.HANDLER, pp.PROTOBUF),
    "core: data plane, batcher, request/response": (pp.CORE,),
    "hand-off: executor, backend IPC": (pp.EXECUTOR, pp.IPC_SERVER, pp.IPC_STUB),
    "wake-ups (kernel futex/eventfd)": (pp.KERNEL_FUTEX,),
    "model (model.py, onnxruntime)": (pp.MODEL,),
    "Trio's run loop": (pp.LOOP,),
    "memcpy, malloc, locks (libc, caller unnamed)": (pp.LIBC,),
    "GC": (pp.GC,),
    "kernel: scheduler, IRQ, faults, other calls": (pp.KERNEL_OTHER,),
    "unresolved": (pp.OTHER,),
}

# Triton's threads by the components of their own perf samples (kernel ones
# included: a thread that only receives and polls sockets is a frontend's).
_TRITON_VOTES = {
    pp.HTTP: FRONTEND, pp.GRPC: FRONTEND, pp.PROTOBUF: FRONTEND, pp.HANDLER: FRONTEND,
    pp.KERNEL_NET: FRONTEND, pp.KERNEL_POLL: FRONTEND,
    pp.CORE: CORE_THREADS,
    pp.IPC_SERVER: BACKEND_THREAD, pp.MODEL: BACKEND_THREAD,
}  # fmt: skip
_BACKEND_SHARE = 0.15
# gRPC's library threads, which name themselves.
_GRPC_THREAD_NAMES = ("default-executo", "resolver-execut", "grpc_global_tim", "event_engine",
                      "timer_manager", "grpcpp_sync_ser")  # fmt: skip


def thread_group(server: str, role: str, thread: str, components: dict[str, int]) -> str:
    """The group of one thread: ``role`` "stub" for a child process's threads,
    ``thread`` its name ("main" for a process's first thread), ``components`` its
    perf samples by component."""
    if role == "stub":
        return STUB
    if server != "triton":
        if thread == "main":
            return LOOP_THREAD
        return INSTANCE_THREADS if thread.startswith("instance ") else OTHER_THREADS
    if thread.startswith(_GRPC_THREAD_NAMES):
        return FRONTEND
    # Only the model instance's thread runs the Python backend's server side
    # (python_be.cc ProcessRequests); under gRPC it also serializes the answers
    # and writes them (the response callback runs on it), which can outvote it.
    total = sum(components.values())
    if total and components.get(pp.IPC_SERVER, 0) >= _BACKEND_SHARE * total:
        return BACKEND_THREAD
    votes: collections.Counter[str] = collections.Counter()
    for component, n in components.items():
        if component in _TRITON_VOTES:
            votes[_TRITON_VOTES[component]] += n
    if not votes:
        return OTHER_THREADS
    return votes.most_common(1)[0][0]


_PYSPY_THREAD = re.compile(r"(?:^|;)thread \((\d+)\)")


def read_pyspy_threads(text: str) -> dict[int, pp.Profile]:
    """py-spy's raw output (``--subprocesses --threads --gil``) by the OS thread
    that held the GIL: its stacks name it (``thread (TID): name``, after the
    process frames of the server and, in a stub's, the stub's), so each thread's
    Python time splits as its own samples do (0: a stack without one)."""
    lines: dict[int, list[str]] = collections.defaultdict(list)
    for line in text.splitlines():
        tids = _PYSPY_THREAD.findall(line)
        lines[int(tids[-1]) if tids else 0].append(line)
    return {tid: pp.read_pyspy_raw("\n".join(mine)) for tid, mine in lines.items()}


@dataclass
class Row:
    """One row (server:model) at one point: profile_peers' measurement, the
    server's statistics over the clean window, and the thread groups."""

    measured: pp.Measured
    server_pid: int
    batch: float = float("nan")
    queue_us: float = float("nan")
    direct_us: float = float("nan")  # direct CPU per inference at the batch formed
    direct_batch: int = 0
    pyspy_threads: dict[int, pp.Profile] = field(default_factory=dict)
    round_index: int = 0

    @property
    def server(self) -> str:
        return self.measured.server.split(":")[0]

    def groups(self) -> dict[str, list[tuple[str, float]]]:
        """group -> [(thread, CPU s)] over the clean window."""
        out: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
        for name, cpu in self.measured.by_thread.items():
            role, rest = name.split(" ", 1)  # the thread's name may hold spaces
            thread, tid = rest.rsplit(" ", 1)
            mine = {c: n for (t, c), n in self.measured.perf.by_tid.items() if t == int(tid)}
            out[thread_group(self.server, role, thread, mine)].append((name, cpu))
        return out

    def threads(self) -> str:
        """Each thread of 2 µs per inference or more: its group, its CPU and the
        components of its perf samples (those of 15% or more)."""
        n = max(self.measured.inferences, 1)
        listed = []
        for group, threads in self.groups().items():
            for name, cpu in threads:
                us = 1e6 * cpu / n
                if us < 2:
                    continue
                tid = int(name.rsplit(" ", 1)[1])
                mine = {c: k for (t, c), k in self.measured.perf.by_tid.items() if t == tid}
                total = sum(mine.values())
                parts = ", ".join(
                    f"{c.split(' (')[0]} {k / total:.0%}"
                    for c, k in sorted(mine.items(), key=lambda kv: -kv[1])
                    if k >= 0.15 * total
                )
                listed.append((us, f"{group}: {name} {us:.0f}" + (f" ({parts})" if parts else "")))
        return "; ".join(text for _, text in sorted(listed, reverse=True))

    def top_python(self, group: str, n: int) -> list[tuple[float, str]]:
        """The ``n`` Python lines (py-spy's innermost frames) of ``group``'s threads
        that cost the most: (µs per inference, "step: frame"), the group's
        interpreter time split by its py-spy samples."""
        threads = self.groups().get(group, [])
        tids = {int(name.rsplit(" ", 1)[1]) for name, _ in threads}
        perf = self.measured.perf
        samples = sum(k for (t, _), k in perf.by_tid.items() if t in tids)
        python = sum(k for (t, c), k in perf.by_tid.items() if t in tids and c == pp.INTERPRETER)
        if not samples:
            return []
        us = 1e6 * sum(cpu for _, cpu in threads) / max(self.measured.inferences, 1)
        python_us = us * python / samples
        leaves: collections.Counter[str] = collections.Counter()
        total = 0
        for tid in tids:
            spy = self.pyspy_threads.get(tid)
            if spy is None:
                continue
            total += spy.total
            for (component, _, frame), k in spy.symbols.items():
                step = next((s for s, cs in STEPS.items() if component in cs), "unresolved")
                leaves[f"{step.split(' (')[0]}: {frame}"] += k
        if not total:
            return []
        return [(python_us * k / total, leaf) for leaf, k in leaves.most_common(n)]

    def group_us(self) -> dict[str, float]:
        n = max(self.measured.inferences, 1)
        return {g: 1e6 * sum(cpu for _, cpu in threads) / n for g, threads in self.groups().items()}

    def group_steps(self) -> dict[str, dict[str, float]]:
        """group -> step -> us per inference: the group's CPU split by its threads'
        perf samples, the interpreter's share of them by py-spy's samples of the
        same group."""
        n = max(self.measured.inferences, 1)
        perf = self.measured.perf
        out: dict[str, dict[str, float]] = {}
        for group, threads in self.groups().items():
            tids = {int(name.rsplit(" ", 1)[1]) for name, _ in threads}
            samples: collections.Counter[str] = collections.Counter()
            for (tid, component), count in perf.by_tid.items():
                if tid in tids:
                    samples[component] += count
            total = sum(samples.values())
            us = 1e6 * sum(cpu for _, cpu in threads) / n
            parts: dict[str, float] = collections.defaultdict(float)
            if not total:
                parts[pp.OTHER] += us
            for component, count in samples.items():
                share = us * count / total if total else 0.0
                if component != pp.INTERPRETER:
                    parts[component] += share
                    continue
                spy = pp.Profile()
                for tid in tids:
                    if tid in self.pyspy_threads:
                        spy.samples.update(self.pyspy_threads[tid].samples)
                        spy.total += self.pyspy_threads[tid].total
                if not spy.total:
                    parts[pp.OTHER] += share
                    continue
                for c, k in spy.samples.items():
                    parts[c] += share * k / spy.total
            out[group] = {
                step: sum(parts.get(c, 0.0) for c in components)
                for step, components in STEPS.items()
            }
        return out

    def raw(self) -> dict:
        return {
            **self.measured.raw(),
            "server_pid": self.server_pid,
            "batch": self.batch,
            "queue_us": self.queue_us,
            "direct_us": self.direct_us,
            "direct_batch": self.direct_batch,
            "round_index": self.round_index,
        }

    @classmethod
    def from_raw(cls, raw: dict, folder: Path) -> Row:
        measured = pp.Measured.from_raw({k: raw[k] for k in pp.Measured.RAW}, folder)
        row = cls(measured, raw["server_pid"], raw["batch"], raw["queue_us"], raw["direct_us"],
                  raw["direct_batch"], round_index=raw["round_index"])  # fmt: skip
        spy = folder / f"{measured.stem}.pyspy.txt"
        if spy.exists():
            row.pyspy_threads = read_pyspy_threads(spy.read_text())
        return row


# ------------------------------------------------------------------ the models

MODEL_PY = '''
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """The small CNN run by onnxruntime (CNN_MODE "onnxruntime"), or zeros of its
    output's shape (CNN_MODE "null"): the same model.py on both servers."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        mode = parameters.get("CNN_MODE", {}).get("string_value", "null")
        self.session = None
        if mode == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
            path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
            self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        if self.session is None:
            outputs = [np.zeros((x.shape[0], 1000), np.float32) for x in inputs]
        else:
            batch = inputs[0] if len(inputs) == 1 else np.concatenate(inputs)
            result = self.session.run(None, {"INPUT0": batch})[0]
            outputs, start = [], 0
            for x in inputs:
                outputs.append(result[start : start + x.shape[0]])
                start += x.shape[0]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]) for y in outputs]
'''

PY_CONFIG = f"""name: "{{name}}"
backend: "python"
max_batch_size: {MAX_BATCH}
input [{{{{ name: "INPUT0" data_type: TYPE_FP32 dims: [3, 224, 224] }}}}]
output [{{{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [1000] }}}}]
instance_group [{{{{ count: 1 kind: KIND_CPU }}}}]
dynamic_batching {{{{ max_queue_delay_microseconds: {DELAY_US} }}}}
parameters {{{{ key: "CNN_MODE" value: {{{{ string_value: "{{mode}}" }}}} }}}}
"""

CNN_SPEC = ModelSpec("cnn_onnx", "onnxruntime", "model.onnx", "INPUT0", "OUTPUT0")


def write_repository(root: Path, onnx_file: Path, execution_mode: str = "",
                     execute_on: str = "", onnx: bool = False) -> Path:  # fmt: skip
    """cnn_py and cnn_null (with ``onnx`` cnn_onnx too) under ``root``/models;
    ``execution_mode`` and ``execute_on`` as benchmarks.peers.triton's (trionserve only)."""
    repository = root / "models"
    extra = ""
    if execution_mode:
        value = f'{{ string_value: "{execution_mode}" }}'
        extra += f'parameters {{ key: "EXECUTION_MODE" value: {value} }}\n'
    if execute_on:
        value = f'{{ string_value: "{execute_on}" }}'
        extra += f'parameters {{ key: "INPROCESS_EXECUTE_ON" value: {value} }}\n'
    for name, mode in (("cnn_py", "onnxruntime"), ("cnn_null", "null")):
        version = repository / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(MODEL_PY)
        shutil.copy(onnx_file, version / "model.onnx")
        (repository / name / "config.pbtxt").write_text(
            PY_CONFIG.format(name=name, mode=mode) + extra
        )
    if onnx:
        version = repository / "cnn_onnx" / "1"
        version.mkdir(parents=True)
        shutil.copy(onnx_file, version / "model.onnx")
        (repository / "cnn_onnx" / "config.pbtxt").write_text(_config(CNN_SPEC, DELAY_US))
    return repository


class TritonCnn(Triton):
    """Triton serving cnn_py and cnn_null, onnxruntime added to its environment
    (the version this environment has)."""

    onnx_file: Path

    def install(self, log=print) -> None:
        super().install(log=log)
        version = importlib.metadata.version("onnxruntime")
        marker = self.venv / ".onnxruntime"
        if marker.exists() and marker.read_text() == version:
            return
        log(f"[triton] installing onnxruntime=={version} into its environment ...")
        done = subprocess.run(
            [str(self.python), "-m", "pip", "install", "-q", f"onnxruntime=={version}"],
            capture_output=True, text=True, timeout=self.install_timeout, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise PeerUnavailable(f"onnxruntime did not install: {done.stderr[-400:]}")
        marker.write_text(version)

    def write_models(self, workdir: Path) -> Path:
        return write_repository(workdir, self.onnx_file)

    @staticmethod
    def _wait_model(http_url: str, timeout: float) -> None:
        _wait_ready(http_url, PY_MODELS, timeout)


def _wait_ready(http_url: str, models: tuple[str, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for model in models:
        while True:
            try:
                model_stats(http_url, model)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"model {model} did not become ready") from None
                time.sleep(0.2)


def start_servers(names: list[str], cache: Path, tmp: Path, log):
    """name -> (process, pid, HTTP URL, gRPC URL) for each server that started."""
    onnx_file = tmp / "cnn.onnx"
    write_cnn_onnx(onnx_file)
    servers = {}
    for name in names:
        if name == "triton":
            peer = TritonCnn(cache / "peers", 900.0)
            peer.onnx_file = onnx_file
            try:
                peer.install(log=log)
                (tmp / "triton").mkdir()
                running = peer.start(tmp / "triton", 180.0)
            except PeerUnavailable as exc:
                log(f"[triton] skipped: {exc}")
                continue
            t = running.target
            servers[name] = (running.process, t.pid, str(t.http_url), str(t.grpc_url))
            continue
        mode, execute_on = {"inproc": ("in_process", ""), "loop": ("in_process", "event_loop")}.get(
            name, ("", "")
        )
        repository = write_repository(tmp / name, onnx_file, mode, execute_on, onnx=name == "onnx")
        process, target = start_trionserve(name, repository=repository)
        _wait_ready(str(target.http_url), PY_MODELS, 120.0)
        servers[name] = (process, target.pid, str(target.http_url), str(target.grpc_url))
    return servers


# ------------------------------------------------------------------ tables


def _direct_cell(row: Row) -> str:
    if row.direct_batch == 0:
        return "—"
    served = row.measured.cpu_us
    return f"{row.direct_us:.0f} (b{row.direct_batch}) / {served / 1:.0f} = " + (
        f"**{row.direct_us / served:.2f}**" if served else "—"
    )


def format_groups(rows: list[Row]) -> str:
    out = []
    for point in dict.fromkeys(r.measured.point for r in rows):
        present = [r for r in rows if r.measured.point == point]
        loads = [x for r in present for x in r.measured.load]
        groups = [g for g in GROUPS if any(r.group_us().get(g, 0) >= 0.5 for r in present)]
        out.append(
            f"\n#### {point.replace(':', ' c=')}: µs of CPU per inference by thread group "
            f"(load average {min(loads):.1f}-{max(loads):.1f})\n"
        )
        out.append(
            "| row | infer/s | batch | queue µs | " + " | ".join(groups)
            + " | total | direct / served CPU |"
        )  # fmt: skip
        out.append("|---|" + "---:|" * (len(groups) + 5))
        for r in present:
            us = r.group_us()
            m = r.measured
            cells = " | ".join(f"{us.get(g, 0.0):.0f}" for g in groups)
            rate = m.inferences / max(m.seconds, 1e-9)
            out.append(
                f"| {m.server} r{r.round_index} | {rate:.0f} | {r.batch:.2f} | {r.queue_us:.0f} | "
                f"{cells} | **{m.cpu_us:.0f}** | {_direct_cell(r)} |"
            )
        for r in present:
            steps = r.group_steps()
            head = f"{r.measured.server} {point} r{r.round_index}"
            out.append(f"\n{head}, by thread group and step (µs per inference):\n")
            names = [g for g in GROUPS if g in steps and sum(steps[g].values()) >= 0.5]
            out.append("| step | " + " | ".join(names) + " |")
            out.append("|---|" + "---:|" * len(names))
            for step in STEPS:
                if all(steps[g][step] < 0.5 for g in names):
                    continue
                cells = " | ".join(f"{steps[g][step]:.0f}" for g in names)
                out.append(f"| {step} | {cells} |")
            out.append(f"\nThreads: {r.threads()}")
            for group in (LOOP_THREAD, STUB):
                top = r.top_python(group, 12)
                if top:
                    listed = "; ".join(f"{frame} {us:.0f}" for us, frame in top)
                    out.append(f"\n{group}, its costliest Python lines (µs): {listed}")
    return "\n".join(out)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def format_summary(rows: list[Row]) -> str:
    """Each point's rows over every round and run: the median of each thread
    group's µs per inference, the total's median and range, direct / served's
    medians; then the median of each (group, step) cell of each row."""
    out = []
    for point in dict.fromkeys(r.measured.point for r in rows):
        present = [r for r in rows if r.measured.point == point]
        labels = list(dict.fromkeys(r.measured.server for r in present))
        groups = [g for g in GROUPS if any(r.group_us().get(g, 0) >= 0.5 for r in present)]
        loads = [x for r in present for x in r.measured.load]
        out.append(
            f"\n#### {point.replace(':', ' c=')}: median µs of CPU per inference "
            f"(load average {min(loads):.1f}-{max(loads):.1f})\n"
        )
        out.append("| row | n | infer/s | batch | " + " | ".join(groups) + " | total (range) | "
                   "direct / served |")  # fmt: skip
        out.append("|---|" + "---:|" * (len(groups) + 5))
        for label in labels:
            mine = [r for r in present if r.measured.server == label]
            us = [r.group_us() for r in mine]
            cells = " | ".join(f"{_median([u.get(g, 0.0) for u in us]):.0f}" for g in groups)
            totals = [r.measured.cpu_us for r in mine]
            rates = [r.measured.inferences / max(r.measured.seconds, 1e-9) for r in mine]
            ratios = [r.direct_us / r.measured.cpu_us for r in mine if r.direct_batch]
            ratio = (
                f"{_median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "—"
            )
            out.append(
                f"| {label} | {len(mine)} | {_median(rates):.0f} | "
                f"{_median([r.batch for r in mine]):.2f} | {cells} | **{_median(totals):.0f}** "
                f"({min(totals):.0f}-{max(totals):.0f}) | {ratio} |"
            )
        for label in labels:
            mine = [r.group_steps() for r in present if r.measured.server == label]
            names = [g for g in GROUPS if any(sum(m.get(g, {}).values()) >= 0.5 for m in mine)]
            out.append(f"\n{label} {point}, median µs per inference by thread group and step:\n")
            out.append("| step | " + " | ".join(names) + " |")
            out.append("|---|" + "---:|" * len(names))
            for step in STEPS:
                values = [_median([m.get(g, {}).get(step, 0.0) for m in mine]) for g in names]
                if all(v < 0.5 for v in values):
                    continue
                out.append(f"| {step} | " + " | ".join(f"{v:.0f}" for v in values) + " |")
    return "\n".join(out)


# ------------------------------------------------------------------ the run


def _direct(runner, batch: int, seconds: float) -> float:
    """Direct CPU per inference (µs) at ``batch``: this process, one thread."""
    result, cpu, _ = run_direct(runner, batch, seconds, 0.5)
    return 1e6 * cpu / max(result.requests, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", default="http:1,http:8,grpc:1,grpc:8")
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--seconds", type=float, default=3.0, help="each window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="points repeated, order rotated")
    parser.add_argument("--cache", type=Path, default=default_cache())
    parser.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: PyPI's)")
    parser.add_argument("--perf", default=shutil.which("perf"), help="perf (none: no profile)")
    parser.add_argument("--call-graph", default="fp", help="perf's --call-graph")
    parser.add_argument(
        "--triton-call-graph",
        default="dwarf,16384",
        help="perf's --call-graph for Triton: whole chains through its build without frame "
        "pointers name the callers of libc's memcpy (the body's copies)",
    )
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--out", type=Path, help="keep the profiles and measurements here")
    parser.add_argument("--top", type=int, default=15, help="symbols listed per profile")
    parser.add_argument(
        "--reanalyze",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="the tables again from what --out kept (no servers, no load); with several "
        "runs' folders, first their medians",
    )
    args = parser.parse_args()
    if args.reanalyze:
        rows = []
        for folder in args.reanalyze:
            kept = json.loads((folder / "measurements.json").read_text())
            rows += [Row.from_raw(raw, folder) for raw in kept]
        print(format_summary(rows))
        print(format_groups(rows))
        print(pp.format_symbols([r.measured for r in rows], args.top))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    wanted = [tuple(r.strip().split(":")) for r in args.rows.split(",") if r.strip()]
    for pair in wanted:
        if len(pair) != 2 or pair[0] not in SERVERS:
            raise SystemExit(f"--rows: server:model with a server of {SERVERS}, not {pair}")
    points, py_spy, command = pp.points_and_tools(args)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="profile-peers-cnn-") as tmp:
        # The profiles are kept (in ``tmp`` without --out): py-spy's are read
        # again by thread group.
        keep = args.out or Path(tmp) / "profiles"
        keep.mkdir(parents=True, exist_ok=True)
        servers = start_servers(list(dict.fromkeys(s for s, _ in wanted)), args.cache, Path(tmp),
                                log=print)  # fmt: skip
        runner = direct_runner(CNN_SPEC, Path(tmp) / "cnn.onnx")
        order = [(s, m) for s, m in wanted if s in servers]
        try:
            for round_index in range(args.rounds):
                for point in points:
                    protocol, concurrency = point.split(":")
                    direct = {1: _direct(runner, 1, args.seconds)}
                    shift = round_index % len(order)
                    done: list[Row] = []
                    for server, model in order[shift:] + order[:shift]:
                        _, pid, http_url, grpc_url = servers[server]
                        url = http_url if protocol == "http" else grpc_url
                        loader = pp.Loader(command, url, protocol, int(concurrency), model)
                        label = f"{server}:{model}"
                        try:
                            time.sleep(args.warmup)
                            before = model_stats(http_url, model)
                            measured = pp.measure(
                                label, pid, http_url, args.seconds, args.perf,
                                None if server == "triton" else py_spy,
                                keep, f"{point}-r{round_index}",
                                (args.triton_call_graph or args.call_graph)
                                if server == "triton" else args.call_graph,
                                model,
                            )  # fmt: skip
                        finally:
                            error = loader.stop()
                        after = model_stats(http_url, model)
                        measured.point = point
                        measured.error = error
                        row = Row(measured, pid, round_index=round_index)
                        row.batch, phases = stats_delta(before, after)
                        row.queue_us = phases["queue"]
                        spy = keep / f"{measured.stem}.pyspy.txt"
                        if spy.exists():
                            row.pyspy_threads = read_pyspy_threads(spy.read_text())
                        done.append(row)
                        print(
                            f"{point:<7} {label:<16} {measured.cpu_us:6.0f} µs/inf "
                            f"({measured.inferences / measured.seconds:4.0f} infer/s, batch "
                            f"{row.batch:.2f}, load {measured.load[0]:.1f}) {error[-200:]}",
                            flush=True,
                        )
                    for row in done:
                        if row.measured.server.split(":")[1] == "cnn_null":
                            continue
                        batch = max(1, round(row.batch)) if row.batch == row.batch else 1
                        if batch not in direct:
                            direct[batch] = _direct(runner, batch, args.seconds)
                        row.direct_us, row.direct_batch = direct[batch], batch
                    print(f"{point:<7} direct           " + ", ".join(
                        f"b{b} {us:.0f} µs/inf" for b, us in sorted(direct.items())
                    ), flush=True)  # fmt: skip
                    rows.extend(done)
        finally:
            for process, *_ in servers.values():
                process.stop()
    if args.out:
        (args.out / "measurements.json").write_text(json.dumps([r.raw() for r in rows], indent=1))
    print(format_groups(rows))
    print(pp.format_symbols([r.measured for r in rows], args.top))


if __name__ == "__main__":
    main()
