"""A decoupled model streaming to a client that stops reading: the responses the
server holds for one request are bounded by bytes (--max-undelivered-response-bytes);
past the bound the request is cancelled with RESOURCE_EXHAUSTED and the model stops."""

from __future__ import annotations

import queue
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.helpers import wait_for
from tests.repository import python_model
from tests.serverproc import serving

MIB = 1024 * 1024
CHUNK = 256 * 1024  # bytes per response
COUNT = 400  # responses the model would send: 100 MiB, far past every bound

CONFIG = """
name: "firehose"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "marker" value: { string_value: "%s" } }
"""

MODEL = f"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.marker = config["parameters"]["marker"]["string_value"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sent = 0
            for index in range(count):
                if sender.is_cancelled():
                    break
                out = pb_utils.Tensor("OUT", np.full({CHUNK}, index % 251, np.uint8))
                sender.send(pb_utils.InferenceResponse([out]))
                sent += 1
            with open(self.marker, "w") as f:
                f.write(str(sent))
            if not sender.is_cancelled():
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    python_model(tmp_path / "repo", "firehose", CONFIG % (tmp_path / "marker"), MODEL)
    return tmp_path / "repo"


def test_a_client_that_stops_reading_holds_a_bounded_number_of_bytes(repository, tmp_path):
    limit = 2 * MIB
    marker = tmp_path / "marker"
    args = [
        f"--max-undelivered-response-bytes={limit}",
        # The connection's own buffer for unread responses, at its minimum, so that
        # the request's bound is what the test sees.
        f"--grpc-max-connection-buffer={MIB}",
    ]
    with serving(repository, args=args) as server:
        results: queue.Queue = queue.Queue()
        reading = threading.Event()

        def callback(result, error):
            reading.wait()  # the client stops reading until the server gave up
            results.put((result, error))

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            client.start_stream(callback=callback)
            n = grpcclient.InferInput("N", [1], "INT32")
            n.set_data_from_numpy(np.array([COUNT], np.int32))
            client.async_stream_infer("firehose", [n], request_id="slow")
            # The model stops once the server cancels the request.
            wait_for(marker.exists, "the model to stop sending", 60)
            sent = int(marker.read_text())
            reading.set()
            received, error = 0, None
            while error is None:
                result, error = results.get(timeout=60)
                if error is None:
                    assert result.as_numpy("OUT").nbytes == CHUNK
                    received += 1
        finally:
            reading.set()
            client.stop_stream()
            client.close()

    # The model was stopped long before it sent everything it meant to.
    assert sent < COUNT // 2, sent
    # On a stream the error is the request's error_message (the stream goes on).
    message = error.message()
    print(f"sent={sent} received={received}: {message}")
    assert "--max-undelivered-response-bytes" in message, message
    assert "request 'slow' for model 'firehose'" in message, message
    # The server's own accounting: what it held for the request when it gave up,
    # within the bound, and the response that would have passed it.
    held, following, bound = map(
        int,
        re.search(
            r"hold (\d+) bytes and the next one (\d+) bytes, past the "
            r"limit of (\d+) bytes",
            message,
        ).groups(),
    )
    assert bound == limit
    assert held <= limit < held + following
    assert following == CHUNK
    # Every response the server held was still delivered before the error.
    assert received * CHUNK >= held
    assert received < sent


def test_the_bound_in_the_request_itself():
    import trio

    from trionserve.core.errors import ResourceExhausted
    from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

    def response(nbytes: int) -> InferenceResponse:
        return InferenceResponse(
            "m", "1", outputs=[Tensor("OUT", "UINT8", np.zeros(nbytes, np.uint8))]
        )

    async def main():
        request = InferenceRequest("m", id="r")
        request.undelivered_limit = 100
        cancelled = []
        request.on_cancel(lambda: cancelled.append(True))
        assert request.send(response(150), final=False)  # the first is always held
        stream = request.stream()
        assert (await anext(stream))[0].outputs[0].data.nbytes == 150  # consumed
        assert request.send(response(60), final=False)
        assert request.send(response(40), final=False)  # 100: at the bound
        assert not request.send(response(1), final=False)  # past it
        assert cancelled == [True] and request.cancelled and request.done
        assert request.undelivered_peak == 150
        assert not request.send(response(1), final=True)  # ignored from now on
        held = [(await anext(stream))[0].outputs[0].data.nbytes for _ in range(2)]
        assert held == [60, 40]
        with pytest.raises(ResourceExhausted, match="hold 100 bytes and the next one 1 bytes"):
            await anext(stream)

    trio.run(main)
