"""NVIDIA Triton Inference Server: the ``tritonserver`` binary bundled in PyPI's
``nvidia-pytriton`` (Triton 2.5x, Python backend only, runs on CPU), serving
Python-backend models: the example ``add_sub_python`` model.py as ``simple`` (and
as ``simple_batched``, behind the dynamic batcher) and an identity model.py as
``identity_fp32``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from benchmarks.matrix import EXAMPLES
from benchmarks.peers.common import BATCHING, MAX_BATCH, Peer, PeerUnavailable, Running, ports

SIMPLE_CONFIG = f"""
name: "simple"
backend: "python"
max_batch_size: {MAX_BATCH}
input [
  {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

IDENTITY_CONFIG = f"""
name: "identity_fp32"
backend: "python"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

IDENTITY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    )
                ]
            )
            for r in requests
        ]
"""


def write_repository(
    root: Path, execution_mode: str = "", execute_on: str = "", instances: int = 1
) -> Path:
    """Triton's models, ``instances`` instances each (one by default); with
    ``execution_mode`` (trionserve only), every model has that ``EXECUTION_MODE``
    parameter (``in_process``), and with ``execute_on`` that
    ``INPROCESS_EXECUTE_ON`` (``event_loop``)."""
    repository = root / "models"
    mode = (
        f'parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "{execution_mode}" }} }}\n'
        if execution_mode
        else ""
    )
    if execute_on:
        where = f'{{ string_value: "{execute_on}" }}'
        mode += f'parameters {{ key: "INPROCESS_EXECUTE_ON" value: {where} }}\n'
    simple = repository / "simple"
    (simple / "1").mkdir(parents=True)
    (simple / "config.pbtxt").write_text(SIMPLE_CONFIG + mode)
    shutil.copy(EXAMPLES / "add_sub_python" / "1" / "model.py", simple / "1" / "model.py")
    batched = repository / "simple_batched"
    (batched / "1").mkdir(parents=True)
    (batched / "config.pbtxt").write_text(
        SIMPLE_CONFIG.replace('name: "simple"', 'name: "simple_batched"') + BATCHING + "\n" + mode
    )
    shutil.copy(EXAMPLES / "add_sub_python" / "1" / "model.py", batched / "1" / "model.py")
    identity = repository / "identity_fp32"
    (identity / "1").mkdir(parents=True)
    (identity / "config.pbtxt").write_text(IDENTITY_CONFIG + mode)
    (identity / "1" / "model.py").write_text(IDENTITY_MODEL)
    if instances != 1:
        for config in repository.glob("*/config.pbtxt"):
            text = config.read_text().replace("count: 1 }", f"count: {instances} }}")
            config.write_text(text)
    return repository


class Triton(Peer):
    name = "triton"
    packages = ["nvidia-pytriton==0.7.0"]
    description = "Triton (nvidia-pytriton's tritonserver), Python-backend models"

    # Instances of each model (benchmarks.peers --instances).
    instances = 1

    def write_models(self, workdir: Path) -> Path:
        """The repository Triton serves (a benchmark of its own adds its models)."""
        return write_repository(workdir, instances=self.instances)

    def start(self, workdir: Path, ready_timeout: float) -> Running:
        package = self.site_packages() / "pytriton"
        dist = package / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not (dist / "bin" / "tritonserver").exists() or not stub.exists():
            raise PeerUnavailable(f"no tritonserver binary or Python {version} stub in {dist}")
        # As PyTriton does: a copy of the server with the stub for this Python.
        server = workdir / "tritonserver"
        shutil.copytree(dist, server, ignore=shutil.ignore_patterns("python_backend_stubs"))
        shutil.copy(stub, server / "backends" / "python" / "triton_python_backend_stub")
        repository = self.write_models(workdir)
        http_port, grpc_port, metrics_port = ports()
        command = [
            str(server / "bin" / "tritonserver"),
            f"--model-repository={repository}",
            f"--backend-directory={server / 'backends'}",
            "--http-address=127.0.0.1",
            f"--http-port={http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}",
            "--allow-metrics=false",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=false",
            "--log-verbose=0",
        ]
        libs = package.parent / "nvidia_pytriton.libs"
        env = {
            "LD_LIBRARY_PATH": str(libs),
            # The stub finds numpy through the environment's Python.
            "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
        }
        return self._launch(
            command, http_port, grpc_port, "/v2/health/ready", ready_timeout, env=env, cwd=workdir
        )
