"""KServe's Python model server (``kserve.ModelServer``, one worker) with two
``kserve.Model`` classes doing the same arithmetic as trionserve's examples."""

from __future__ import annotations

from pathlib import Path

from benchmarks.peers.common import Peer, Running, ports

SERVER = """
import logging
import sys

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class Simple(Model):
    def __init__(self):
        super().__init__("simple")
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        a = payload.inputs[0].as_numpy()
        b = payload.inputs[1].as_numpy()
        binary = payload.use_binary_outputs
        outputs = []
        for name, value in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
            out = InferOutput(name, list(value.shape), "INT32")
            out.set_data_from_numpy(value, binary_data=binary)
            outputs.append(out)
        return InferResponse(payload.id or "", self.name, outputs, use_binary_outputs=binary)


class Identity(Model):
    def __init__(self):
        super().__init__("identity_fp32")
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        value = payload.inputs[0].as_numpy()
        binary = payload.use_binary_outputs
        out = InferOutput("OUTPUT0", list(value.shape), "FP32")
        out.set_data_from_numpy(value, binary_data=binary)
        return InferResponse(payload.id or "", self.name, [out], use_binary_outputs=binary)


if __name__ == "__main__":
    # No per-request access and latency logs: they would cost KServe CPU that
    # the other servers do not spend.
    logging.disable(logging.INFO)
    http_port, grpc_port = int(sys.argv[1]), int(sys.argv[2])
    sys.argv = sys.argv[:1]
    ModelServer(
        http_port=http_port, grpc_port=grpc_port, workers=1, enable_latency_logging=False
    ).start([Simple(), Identity()])
"""


class KServe(Peer):
    name = "kserve"
    packages = ["kserve==0.21.0"]
    description = "KServe ModelServer (one worker), kserve.Model classes"

    def start(self, workdir: Path, ready_timeout: float) -> Running:
        script = workdir / "kserve_server.py"
        script.write_text(SERVER)
        http_port, grpc_port, _ = ports()
        command = [str(self.python), str(script), str(http_port), str(grpc_port)]
        return self._launch(
            command,
            http_port,
            grpc_port,
            "/v2/health/live",
            ready_timeout,
            cwd=workdir,
            unsupported={
                "simple batched http binary": "no server-side batching in kserve.ModelServer",
                "simple batched grpc": "no server-side batching in kserve.ModelServer",
            },
        )
