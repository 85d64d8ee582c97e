"""Clients that never read, and the decoupled model they ask (issue 42): shared
by tests/e2e/test_client_budget.py and benchmarks.investigations.slow_readers.

``firehose`` (:func:`write_repository`) answers each request with ``N`` responses
of ``SIZE`` bytes (a BYTES output ``text_output``; a thread per request, as a
streaming model is written), stopping when its request is cancelled.
:func:`sse_client` opens ``generate_stream`` on a raw socket with a 4 KiB receive
buffer and never reads it; :func:`grpc_client` opens a ``ModelStreamInfer``
stream on an HTTP/2 connection that grants no window
(SETTINGS_INITIAL_WINDOW_SIZE 0, no WINDOW_UPDATE).
"""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

CONFIG = """
name: "firehose"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
input [ { name: "SIZE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.stream, args=(request,), daemon=True).start()
        return None

    def stream(self, request):
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
        size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
        text = np.array([b"x" * size], dtype=object)
        for _ in range(count):
            if sender.is_cancelled():
                return
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def write_repository(root: Path) -> Path:
    model = root / "firehose"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return root


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def sse_client(url: str, count: int, size: int) -> socket.socket:
    """A generate_stream request on a socket that will never be read."""
    host, port = url.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = b'{"N": %d, "SIZE": %d}' % (count, size)
    sock.sendall(
        b"POST /v2/models/firehose/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def grpc_client(url: str, count: int, size: int) -> socket.socket:
    """A ModelStreamInfer stream on an HTTP/2 connection that grants no window."""
    import h2.config
    import h2.connection
    import h2.settings
    import numpy as np
    from tritonclient.grpc import service_pb2

    host, port = url.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    )
    connection.initiate_connection()
    request = service_pb2.ModelInferRequest(model_name="firehose", id="slow")
    for name, value in (("N", count), ("SIZE", size)):
        tensor = request.inputs.add(name=name, datatype="INT32")
        tensor.shape.append(1)
        request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    message = request.SerializeToString()
    stream = connection.get_next_available_stream_id()
    connection.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/inference.GRPCInferenceService/ModelStreamInfer"),
            (":authority", url),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )
    connection.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message)
    sock.sendall(connection.data_to_send())
    return sock


def status_line(sock: socket.socket, timeout: float = 0.2) -> str:
    """What the server answered first, as far as 4 KiB shows it."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(4096)
    except OSError:
        return "nothing"
    if data.startswith(b"HTTP/"):
        return data.split(b"\r\n", 1)[0].decode()
    return "h2 frames" if data else "closed"
