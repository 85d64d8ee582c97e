"""Seldon MLServer with a custom runtime (``MLModel`` subclasses) doing the same
arithmetic as trionserve's examples; default settings otherwise (one parallel
inference worker). MLServer's HTTP API has no binary tensor extension."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.peers.common import BATCH_DELAY_SECONDS, MAX_BATCH, Peer, Running, ports

RUNTIME = """
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class SimpleRuntime(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        a = NumpyCodec.decode_input(payload.inputs[0])
        b = NumpyCodec.decode_input(payload.inputs[1])
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[
                NumpyCodec.encode_output("OUTPUT0", a + b),
                NumpyCodec.encode_output("OUTPUT1", a - b),
            ],
        )


class IdentityRuntime(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        value = NumpyCodec.decode_input(payload.inputs[0])
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[NumpyCodec.encode_output("OUTPUT0", value)],
        )
"""


class MLServer(Peer):
    name = "mlserver"
    # MLServer 1.7.1 does not start with newer uvloop releases.
    packages = ["mlserver==1.7.1", "uvloop==0.21.0"]
    description = "MLServer with a custom runtime"

    def start(self, workdir: Path, ready_timeout: float) -> Running:
        root = workdir / "mlserver"
        root.mkdir()
        (root / "runtime.py").write_text(RUNTIME)
        http_port, grpc_port, metrics_port = ports()
        settings = {
            "debug": False,
            "host": "127.0.0.1",
            "http_port": http_port,
            "grpc_port": grpc_port,
            "metrics_port": metrics_port,
        }
        (root / "settings.json").write_text(json.dumps(settings))
        models = {
            "simple": {"implementation": "runtime.SimpleRuntime"},
            # MLServer's adaptive batching: its dynamic batcher.
            "simple_batched": {
                "implementation": "runtime.SimpleRuntime",
                "max_batch_size": MAX_BATCH,
                "max_batch_time": BATCH_DELAY_SECONDS,
            },
            "identity_fp32": {"implementation": "runtime.IdentityRuntime"},
        }
        for name, settings in models.items():
            (root / name).mkdir()
            (root / name / "model-settings.json").write_text(json.dumps({"name": name, **settings}))
        command = [str(self.venv / "bin" / "mlserver"), "start", str(root)]
        return self._launch(
            command,
            http_port,
            grpc_port,
            "/v2/health/ready",
            ready_timeout,
            cwd=root,
            unsupported={
                "simple http binary": "no binary tensor extension",
                "simple batched http binary": "no binary tensor extension",
                "identity 4MB http": "no binary tensor extension",
            },
        )
