"""tritonserver's command line, unchanged, starts trionserve: every flag parses, and
the ones that mean something here do it through a real server."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers import cli_usage, simple_inputs
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve._generated import model_config_pb2 as mc
from trionserve.backends.backend_config import parse_backend_config
from trionserve.backends.manager import BackendManager
from trionserve.backends.python.settings import StubSettings
from trionserve.cli.options import options_from_args
from trionserve.core.errors import InvalidArgument
from trionserve.protocol.restricted import RestrictedCategory, Restriction
from trionserve.repository.config import read_model_config
from trionserve.repository.snapshot import file_changes, snapshot_model

# The deployment command line of the task that asked for this, as written for Triton.
DEPLOYMENT = (
    "--model-repository=/models --strict-readiness=false --log-info=true "
    "--log-file=/tmp/t.log --backend-config=python,shm-default-byte-size=10485760 "
    "--pinned-memory-pool-byte-size=0 --cuda-memory-pool-byte-size=0:0 "
    "--http-thread-count=8 --reuse-grpc-port=1 --model-config-name=h100 --rate-limit=off"
).split()

# Every flag of tritonserver's command_line_parser.cc (r24.xx-r25.xx) with a value
# a Triton user would give it; flags refused here are in REFUSED below.
EVERY_FLAG = [
    "--id=server",
    "--exit-timeout-secs=30",
    "--model-store=/models",
    "--exit-on-error=true",
    "--disable-auto-complete-config",
    "--strict-readiness=true",
    "--model-control-mode=poll",
    "--repository-poll-secs=5",
    "--model-config-name=h100",
    "--model-load-thread-count=4",
    "--model-load-retry-count=2",
    "--model-namespacing=false",
    "--enable-peer-access=true",
    "--allow-http=true",
    "--http-address=0.0.0.0",
    "--http-port=8000",
    "--reuse-http-port=false",
    "--http-header-forward-pattern=^x-",
    "--http-thread-count=8",
    "--http-max-input-size=67108864",
    "--http-restricted-api=model-repository,trace:admin-key=admin-value",
    "--allow-grpc=true",
    "--grpc-address=0.0.0.0",
    "--grpc-port=8001",
    "--reuse-grpc-port=false",
    "--grpc-header-forward-pattern=^x-",
    "--grpc-restricted-protocol=inference:infer-key=infer-value",
    "--grpc-infer-thread-count=2",
    "--grpc-infer-allocation-pool-size=8",
    "--grpc-max-response-pool-size=100",
    "--grpc-use-ssl=false",
    "--grpc-use-ssl-mutual=false",
    "--grpc-infer-response-compression-level=medium",
    "--grpc-keepalive-time=7200000",
    "--grpc-keepalive-timeout=20000",
    "--grpc-keepalive-permit-without-calls=0",
    "--grpc-http2-max-pings-without-data=2",
    "--grpc-http2-min-recv-ping-interval-without-data=300000",
    "--grpc-http2-max-ping-strikes=2",
    "--grpc-max-connection-age=60000",
    "--grpc-max-connection-age-grace=5000",
    "--log-verbose=0",
    "--log-info=true",
    "--log-warning=on",
    "--log-error=yes",
    "--log-format=ISO8601",
    "--log-file=/tmp/t.log",
    "--allow-sagemaker=false",
    "--sagemaker-port=8080",
    "--sagemaker-safe-port-range=8081-8090",
    "--sagemaker-thread-count=8",
    "--allow-vertex-ai=false",
    "--vertex-ai-port=8080",
    "--vertex-ai-thread-count=8",
    "--vertex-ai-default-model=simple",
    "--allow-metrics=true",
    "--allow-gpu-metrics=false",
    "--allow-cpu-metrics=true",
    "--metrics-address=0.0.0.0",
    "--metrics-port=8002",
    "--metrics-interval-ms=2000",
    "--metrics-config=summary_latencies=false",
    "--trace-config=level=OFF",
    "--cache-config=local,size=1048576",
    "--cache-directory=/opt/tritonserver/caches",
    "--rate-limit=off",
    "--rate-limit-resource=R1:10:0",
    "--pinned-memory-pool-byte-size=268435456",
    "--cuda-memory-pool-byte-size=0:67108864",
    "--cuda-virtual-address-size=0:1073741824",
    "--min-supported-compute-capability=6.0",
    "--buffer-manager-thread-count=0",
    "--host-policy=gpu_0,numa-node=0",
    "--model-load-gpu-limit=0:0.8",
    "--allow-client-shm=false",
    "--backend-directory=/opt/tritonserver/backends",
    "--backend-config=tensorflow,version=2",
    "--repoagent-directory=/opt/tritonserver/repoagents",
    "--strict-model-config=false",
    "--trace-file=/tmp/trace.json",
    "--trace-level=OFF",
    "--trace-rate=1000",
    "--trace-count=-1",
    "--trace-log-frequency=0",
]

REFUSED = [
    ("--rate-limit=sometimes", "--rate-limit"),
    ("--rate-limit-resource=R1", "--rate-limit-resource option format"),
    ("--sagemaker-safe-port-range=80", "--sagemaker-safe-port-range"),
    ("--allow-vertex-ai=1", "--allow-vertex-ai"),
    ("--http-restricted-api=model-reposit:k1=v1", "unknown restricted api 'model-reposit'"),
    ("--grpc-restricted-protocol=health:k1", "--grpc-restricted-protocol option format"),
    ("--grpc-infer-thread-count=1", "in the range 2 to 128"),
    ("--backend-config=,shm-default-byte-size=1", "No backend specified"),
    ("--backend-config=python,shm-default-byte-size", "--backend-config option format is"),
    ("--model-config-name=", "configuration name"),
    ("--grpc-use-ssl=true", "requires --grpc-server-cert"),
]


# -- parsing ----------------------------------------------------------------------------


def test_deployment_command_line_parses(tmp_path):
    options = options_from_args(DEPLOYMENT)
    assert options.strict_readiness is False
    assert options.log_info is True and options.log_file == "/tmp/t.log"
    assert options.backend_config == {"python": {"shm-default-byte-size": "10485760"}}
    assert options.grpc.reuse_port is True and options.http.reuse_port is False
    assert options.model_config_name == "h100"


def test_space_separated_values_parse_the_same():
    spaced = []
    for arg in DEPLOYMENT:
        spaced += arg.split("=", 1)
    assert options_from_args(spaced) == options_from_args(DEPLOYMENT)


def test_every_tritonserver_flag_parses():
    options = options_from_args(EVERY_FLAG)
    assert options.model_control_mode.value == "poll"
    assert options.grpc.infer_response_compression_level == "med"  # Triton's "medium"
    assert options.http.header_forward_pattern == "(?i)^x-"
    trace = options.http.restricted_apis.get(RestrictedCategory.TRACE)
    assert trace == Restriction("admin-key", "admin-value")
    infer = options.grpc.restricted_protocols.get(RestrictedCategory.INFERENCE)
    assert infer == Restriction("triton-grpc-protocol-infer-key", "infer-value")
    assert options.log_format == "ISO8601"  # Triton's line format (observability/logging.py)


@pytest.mark.parametrize(
    "spelling, value",
    [
        ("true", True),
        ("1", True),
        ("on", True),
        ("yes", True),
        ("TRUE", True),
        ("false", False),
        ("0", False),
        ("off", False),
        ("no", False),
    ],
)
def test_boolean_spellings(spelling, value):
    options = options_from_args(
        [
            f"--model-repository={EXAMPLES}",
            f"--strict-readiness={spelling}",
            "--reuse-http-port",
            spelling,
            f"--log-error={spelling}",
        ]
    )
    assert options.strict_readiness is value
    assert options.http.reuse_port is value
    assert options.log_error is value


def test_header_pattern_is_case_insensitive_unless_asked():
    options = options_from_args(
        [f"--model-repository={EXAMPLES}", "--http-header-forward-pattern=(?-i)X-Exact"]
    )
    assert options.http.header_forward_pattern == "X-Exact"


@pytest.mark.parametrize("arg, fragment", REFUSED)
def test_refused_flags_name_themselves(arg, fragment):
    result = cli_usage(f"--model-repository={EXAMPLES}", arg)
    assert result.returncode == 1, result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


# -- the pure parts -------------------------------------------------------------------------


def python_config(**parameters: str):
    config = mc.ModelConfig(name="m", backend="python")
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def test_backend_config_sets_python_defaults_that_model_parameters_override():
    backends = BackendManager(
        parse_backend_config(
            [
                "python,shm-default-byte-size=10485760",
                "python,stub-timeout-seconds=5",
                "python,shm-message-queue-size=1000",
                "onnxruntime,intra_op_thread_count=2",
            ]
        )
    )
    defaults = backends.settings_for("python")
    settings = StubSettings.from_config(python_config(), defaults)
    assert settings.shm_default_byte_size == 10485760
    assert settings.stub_timeout == 5.0
    own = StubSettings.from_config(python_config(**{"shm-default-byte-size": "65536"}), defaults)
    assert own.shm_default_byte_size == 65536 and own.stub_timeout == 5.0
    with pytest.raises(InvalidArgument, match="--backend-config=python,stub-timeout"):
        BackendManager({"python": {"stub-timeout-seconds": "soon"}})
    # Another manager (another server) has its own settings: the defaults here.
    other = BackendManager().settings_for("python")
    assert StubSettings.from_config(python_config(), other).shm_default_byte_size == 1 << 20


def write_config(model_dir: Path, relative: str, text: str) -> None:
    path = model_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_model_config_name_picks_configs_name_pbtxt(tmp_path):
    model = tmp_path / "m"
    write_config(model, "config.pbtxt", 'backend: "python"\nmax_batch_size: 1\n')
    write_config(model, "configs/h100.pbtxt", 'backend: "python"\nmax_batch_size: 7\n')
    assert read_model_config(model)[0].max_batch_size == 1
    assert read_model_config(model, config_name="h100")[0].max_batch_size == 7
    assert read_model_config(model, config_name="a100")[0].max_batch_size == 1  # absent
    with pytest.raises(InvalidArgument, match="configs/h100.pbtxt"):
        write_config(model, "configs/h100.pbtxt", "no_such_field: 1\n")
        read_model_config(model, config_name="h100")


def test_snapshots_see_configs_as_configuration(tmp_path):
    model = tmp_path / "m"
    write_config(model, "config.pbtxt", 'backend: "python"\n')
    (model / "1").mkdir()
    before = snapshot_model(model)
    write_config(model, "configs/h100.pbtxt", 'backend: "python"\nmax_batch_size: 7\n')
    changes = file_changes(before, snapshot_model(model))
    assert changes.config and not changes.shared and not changes.versions


# -- through a real server ------------------------------------------------------------------

PARAMS_MODEL = '''
import json
import re
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0: the request's parameters as JSON; INPUT0 == 1 first sleeps 2 s."""

    def execute(self, requests):
        responses = []
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0] == 1:
                time.sleep(2)
            text = request.parameters()
            out = np.array([text.encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
'''
PARAMS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""


def chosen_config(picked: str) -> str:
    """``simple``'s config under another name, saying which file it came from."""
    text = (EXAMPLES / "simple" / "config.pbtxt").read_text()
    text = text.replace('name: "simple"', 'name: "chosen"')
    return text + f'parameters {{ key: "picked" value {{ string_value: "{picked}" }} }}\n'


def compat_repository(root: Path) -> Path:
    for name, extra in (
        ("params", ""),
        (
            "patient",
            'parameters { key: "execute-timeout-seconds" value: { string_value: "30" } }\n',
        ),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(PARAMS_CONFIG + extra)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(PARAMS_MODEL))
    chosen = root / "chosen"
    (chosen / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "simple" / "1" / "model.onnx", chosen / "1" / "model.onnx")
    write_config(chosen, "config.pbtxt", chosen_config("config.pbtxt"))
    write_config(chosen, "configs/h100.pbtxt", chosen_config("h100"))
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: -3\n')
    return root


@pytest.fixture(scope="module")
def compat_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    repository = compat_repository(root / "models")
    log_file = root / "server.log"
    server = ServerProcess(
        repository,
        args=[
            "--exit-on-error=false",
            "--strict-readiness=false",
            "--log-info",
            "true",
            f"--log-file={log_file}",
            "--backend-config=python,execute-timeout-seconds=1",
            "--model-config-name",
            "h100",
            "--model-control-mode=poll",
            "--repository-poll-secs=0.3",
            "--http-header-forward-pattern=^x-fwd",
            "--grpc-header-forward-pattern=^x-fwd",
            "--pinned-memory-pool-byte-size=0",
            "--http-thread-count=8",
        ],
    )
    try:
        server.wait_ready(path="/v2/health/ready")  # not strict: once gRPC listens
        yield server, repository, log_file
    finally:
        server.close()


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, network_timeout=30)


def infer_params(client, model: str, value: int = 0, headers=None) -> dict:
    data = httpclient.InferInput("INPUT0", [1], "INT32")
    data.set_data_from_numpy(np.array([value], dtype=np.int32))
    result = client.infer(model, [data], headers=headers)
    return json.loads(result.as_numpy("OUTPUT0")[0])


def wait_until(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_not_strictly_ready_with_a_failed_model(compat_server):
    server, _repository, _log = compat_server
    client = http_client(server)
    wait_until(lambda: client.is_model_ready("params") and client.is_model_ready("chosen"))
    assert not client.is_model_ready("broken")
    assert client.is_server_ready()  # --strict-readiness=false
    assert grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").is_server_ready()


def test_log_goes_to_the_log_file(compat_server):
    server, _repository, log_file = compat_server
    text = wait_until(
        lambda: (
            log_file.exists() and "server ready" in log_file.read_text() and log_file.read_text()
        )
    )
    assert "--http-thread-count=8 has no effect in trionserve" in text
    assert "--pinned-memory-pool-byte-size=0 has no effect" in text
    assert "server ready" not in server.output()  # not on stderr


def test_http_headers_are_forwarded_as_parameters(compat_server):
    server, _repository, _log = compat_server
    client = http_client(server)
    parameters = infer_params(client, "params", headers={"X-Fwd-Tenant": "blue", "X-Other": "no"})
    assert parameters["x-fwd-tenant"] == "blue"  # the pattern ignores case, as Triton's
    assert "x-other" not in parameters


def test_grpc_headers_are_forwarded_as_parameters(compat_server):
    server, _repository, _log = compat_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    data = grpcclient.InferInput("INPUT0", [1], "INT32")
    data.set_data_from_numpy(np.array([0], dtype=np.int32))
    result = client.infer("params", [data], headers={"x-fwd-tenant": "green"})
    assert json.loads(result.as_numpy("OUTPUT0")[0])["x-fwd-tenant"] == "green"


def test_backend_config_default_applies_and_model_parameters_win(compat_server):
    server, _repository, _log = compat_server
    client = http_client(server)
    # execute-timeout-seconds=1 from --backend-config: a 2 s execute is a hang.
    with pytest.raises(InferenceServerException, match="execute-timeout-seconds"):
        infer_params(client, "params", value=1)
    # "patient" sets execute-timeout-seconds=30 itself.
    assert isinstance(infer_params(client, "patient", value=1), dict)  # answered


def test_model_config_name_is_used_and_polled(compat_server):
    server, repository, _log = compat_server
    client = http_client(server)
    config = client.get_model_config("chosen")
    assert config["parameters"]["picked"]["string_value"] == "h100"
    write_config(repository / "chosen", "configs/h100.pbtxt", chosen_config("h100, edited"))
    wait_until(
        lambda: (
            client.get_model_config("chosen")["parameters"]["picked"]["string_value"]
            == "h100, edited"
        )
    )


def test_log_info_false_keeps_info_out(tmp_path):
    (tmp_path / "models").mkdir()
    log_file = tmp_path / "quiet.log"
    server = ServerProcess(
        tmp_path / "models",
        args=[
            f"--log-file={log_file}",
            "--log-info=false",
            "--log-warning=false",
        ],
    )
    try:
        server.wait_ready()
        assert server.stop() == 0
        assert log_file.exists()
        # No info or warning record (Triton's default format: I/W/E and the date).
        assert not re.search(r"^[IW]\d{4} ", log_file.read_text(), re.M)
    finally:
        server.close()


# -- gRPC over TLS --------------------------------------------------------------------------


def write_self_signed(directory: Path, name: str = "server", issuer=None):
    """A PEM certificate for 127.0.0.1 and localhost, and its key: self-signed (a
    CA) or, with ``issuer`` (cert path, key path), signed by it."""
    x509 = pytest.importorskip("cryptography.x509")
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    if issuer is None:
        issuer_name, signing_key = subject, key
    else:
        issuer_cert = x509.load_pem_x509_certificate(Path(issuer[0]).read_bytes())
        issuer_name = issuer_cert.subject
        signing_key = serialization.load_pem_private_key(Path(issuer[1]).read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .sign(signing_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def simple_only(root: Path) -> Path:
    shutil.copytree(EXAMPLES / "simple", root / "models" / "simple")
    return root / "models"


def test_grpc_over_tls(tmp_path):
    cert, key = write_self_signed(tmp_path)
    server = ServerProcess(
        simple_only(tmp_path),
        args=[
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={cert}",
            f"--grpc-server-key={key}",
        ],
    )
    try:
        server.wait_ready(path="/v2/health/ready")  # once gRPC listens too
        url = f"127.0.0.1:{server.grpc_port}"
        client = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(cert))
        assert client.is_server_live()
        result = client.infer("simple", simple_inputs(module=grpcclient))
        assert result.as_numpy("OUTPUT0").tolist() == [list(range(1, 17))]
        plain = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        server.close()


def test_grpc_over_mutual_tls(tmp_path):
    ca_cert, ca_key = write_self_signed(tmp_path, "ca")
    client_cert, client_key = write_self_signed(tmp_path, "client", issuer=(ca_cert, ca_key))
    server = ServerProcess(
        simple_only(tmp_path),
        args=[
            "--grpc-use-ssl-mutual=true",
            f"--grpc-server-cert={ca_cert}",
            f"--grpc-server-key={ca_key}",
            f"--grpc-root-cert={ca_cert}",
        ],
    )
    try:
        server.wait_ready(path="/v2/health/ready")  # once gRPC listens too
        url = f"127.0.0.1:{server.grpc_port}"
        client = grpcclient.InferenceServerClient(
            url,
            ssl=True,
            root_certificates=str(ca_cert),
            private_key=str(client_key),
            certificate_chain=str(client_cert),
        )
        assert client.is_server_ready()
        anonymous = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(ca_cert))
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("flags", "strict", "warnings"),
    [
        ([], False, []),
        (["--disable-auto-complete-config"], True, []),
        (["--strict-model-config=true"], True, ["has been deprecated"]),
        (
            ["--strict-model-config=false", "--disable-auto-complete-config"],
            True,
            ["has been deprecated", "Overriding deprecated '--strict-model-config' from False"],
        ),
    ],
)
def test_strict_model_config_warns_as_triton_does(capsys, flags, strict, warnings):
    # qa/L0_model_config cli_messages (server command_line_parser.cc 1380, 1868).
    options = options_from_args(["--model-repository=/m", *flags])
    assert options.strict_model_config is strict
    err = capsys.readouterr().err
    assert err.count("Warning: ") == len(warnings)
    for warning in warnings:
        assert warning in err
