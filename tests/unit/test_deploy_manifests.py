"""The deployment manifests are valid, and agree with the server they deploy.

Kubernetes objects (deploy/kubernetes) are validated with kubernetes-validate
against the OpenAPI schemas of the oldest and newest Kubernetes it ships, in
strict mode (unknown fields are errors).

KServe objects (deploy/kserve): no package on PyPI ships KServe's CRD schemas
(the ``kserve`` SDK carries generated model classes, not the CRDs, and pulls a
large server stack), so they are checked against a structural schema written
here from KServe's API types (``ServingRuntimeSpec`` of serving.kserve.io/v1alpha1,
``InferenceServiceSpec`` / ``PredictorSpec`` / ``ModelSpec`` of v1beta1): every
field name is checked (unknown ones are errors), the fields these manifests use
are type-checked, and embedded Kubernetes types (Container, ResourceRequirements,
ObjectMeta, ...) are validated against the Kubernetes schemas above.

Consistency with the server: every flag in the manifests is a flag trionserve
accepts, probes use the v2 health endpoints on the HTTP port, and each
terminationGracePeriodSeconds covers the drain that --exit-timeout-secs allows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trionserve.cli.parser import build_parser

yaml = pytest.importorskip("yaml", reason="manifest validation needs pyyaml (the test extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="manifest validation needs kubernetes-validate (the test extra)"
)
import jsonschema  # noqa: E402
from kubernetes_validate import utils as k8s_utils  # noqa: E402
from referencing import Registry, Resource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KSERVE = ROOT / "deploy" / "kserve"
ADAPTER = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"
OLDEST, NEWEST = "1.27", k8s_utils.latest_version()
PRESTOP_MARGIN = 5  # seconds beyond preStop + drain + unload


def documents(directory: Path) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(directory.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append(
                    (f"{path.name}:{document['kind']}/{document['metadata']['name']}", document)
                )
    return found


def containers(document: dict) -> list[dict]:
    """The containers of a Deployment, ServingRuntime or InferenceService predictor."""
    spec = document["spec"]
    if document["kind"] == "Deployment":
        return spec["template"]["spec"]["containers"]
    if document["kind"] == "ServingRuntime":
        return spec["containers"]
    if document["kind"] == "InferenceService":
        return [spec["predictor"]["model"]]
    return []


def flag_values(args: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


K8S_DOCUMENTS = documents(KUBERNETES)
KSERVE_DOCUMENTS = documents(KSERVE)


def test_the_manifests_exist():
    kinds = {document["kind"] for _, document in K8S_DOCUMENTS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Ingress"} <= kinds
    assert {document["kind"] for _, document in KSERVE_DOCUMENTS} == {
        "ServingRuntime",
        "InferenceService",
    }


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
@pytest.mark.parametrize("name, document", K8S_DOCUMENTS, ids=[n for n, _ in K8S_DOCUMENTS])
def test_kubernetes_objects_match_the_kubernetes_schema(name, document, version):
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} is invalid for Kubernetes {version}: {path}: {exc.message}")


# -- KServe ----------------------------------------------------------------------

K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
INTEGER = {"type": "integer"}
STRING_MAP = {"type": "object", "additionalProperties": STRING}
ANY: dict = {}


def k8s(name: str) -> dict:
    meta = name == "ObjectMeta"
    prefix = "io.k8s.apimachinery.pkg.apis.meta.v1." if meta else "io.k8s.api.core.v1."
    return {"$ref": K8S_DEFS + prefix + name}


def strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def names(text: str, **typed) -> dict:
    """Every field name of a KServe type; ``typed`` fields get a schema, others any."""
    fields = {name: ANY for name in text.split()}
    unknown = set(typed) - set(fields)
    assert not unknown, f"typed fields not in the field list: {unknown}"
    fields.update(typed)
    return fields


def top(api_version: str, kind: str, spec: dict) -> dict:
    return strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": k8s("ObjectMeta"),
            "spec": spec,
            "status": ANY,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


SERVING_RUNTIME = top(
    "serving.kserve.io/v1alpha1",
    "ServingRuntime",
    strict(
        names(
            """affinity annotations builtInAdapter containers disabled grpcDataEndpoint
    grpcEndpoint hostIPC httpDataEndpoint imagePullSecrets labels multiModel
    nodeSelector protocolVersions replicas resourceClaims schedulerName storageHelper
    supportedModelFormats tolerations volumes workerSpec""",
            annotations=STRING_MAP,
            labels=STRING_MAP,
            containers={"type": "array", "minItems": 1, "items": k8s("Container")},
            protocolVersions={
                "type": "array",
                "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
            },
            supportedModelFormats={
                "type": "array",
                "items": strict(
                    {"name": STRING, "version": STRING, "autoSelect": BOOLEAN, "priority": INTEGER},
                    ("name",),
                ),
            },
            multiModel=BOOLEAN,
            disabled=BOOLEAN,
        ),
        ("containers",),
    ),
)

MODEL_SPEC = strict(
    names(
        """args command confidential env envFrom image imagePullPolicy lifecycle
    livenessProbe modelFormat name ports protocolVersion readinessProbe resizePolicy
    resources restartPolicy restartPolicyRules runtime runtimeVersion securityContext
    startupProbe stdin stdinOnce storage storageUri terminationMessagePath
    terminationMessagePolicy tty volumeDevices volumeMounts workingDir""",
        args={"type": "array", "items": STRING},
        env={"type": "array", "items": k8s("EnvVar")},
        modelFormat=strict({"name": STRING, "version": STRING}, ("name",)),
        protocolVersion={"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
        resources=k8s("ResourceRequirements"),
        runtime=STRING,
        storageUri=STRING,
    ),
    ("modelFormat",),
)

PREDICTOR_SPEC = strict(
    names(
        """activeDeadlineSeconds affinity annotations autoScaling
    automountServiceAccountToken batcher canaryTrafficPercent containerConcurrency
    containers deploymentStrategy dnsConfig dnsPolicy enableServiceLinks
    ephemeralContainers hostAliases hostIPC hostNetwork hostPID hostUsers hostname
    hostnameOverride huggingface imagePullSecrets initContainers labels lightgbm logger
    maxReplicas minReplicas model name nodeName nodeSelector onnx os overhead paddle
    pmml preemptionPolicy priority priorityClassName pytorch readinessGates
    resourceClaims resources restartPolicy runtimeClassName scaleMetric
    scaleMetricType scaleTarget schedulerName schedulingGates schedulingGroup
    securityContext serviceAccount serviceAccountName setHostnameAsFQDN
    shareProcessNamespace sklearn storageContainerName storageUris subdomain
    tensorflow terminationGracePeriodSeconds timeout tolerations
    topologySpreadConstraints triton volumes workerSpec xgboost""",
        minReplicas={"type": "integer", "minimum": 0},
        maxReplicas={"type": "integer", "minimum": 0},
        terminationGracePeriodSeconds=INTEGER,
        model=MODEL_SPEC,
    )
)

INFERENCE_SERVICE = top(
    "serving.kserve.io/v1beta1",
    "InferenceService",
    strict(
        names(
            "canary explainer predictor tracing transformer",
            predictor=PREDICTOR_SPEC,
        ),
        ("predictor",),
    ),
)

KSERVE_SCHEMAS = {"ServingRuntime": SERVING_RUNTIME, "InferenceService": INFERENCE_SERVICE}


def kserve_validator(kind: str) -> jsonschema.protocols.Validator:
    definitions = k8s_utils.schema_contents(  # NEWEST is a full version, e.g. 1.37.0
        f"kubernetes-json-schema/v{NEWEST}-local-strict/_definitions.json", NEWEST
    )
    registry = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(KSERVE_SCHEMAS[kind], registry=registry)


@pytest.mark.parametrize("name, document", KSERVE_DOCUMENTS, ids=[n for n, _ in KSERVE_DOCUMENTS])
def test_kserve_objects_match_kserve_api_types(name, document):
    errors = sorted(
        kserve_validator(document["kind"]).iter_errors(document), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(
        f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors
    )


def test_the_kserve_schema_rejects_what_kserve_would():
    """The structural schema is not vacuous: misspelt and mistyped fields fail."""
    ((_, runtime),) = [d for d in KSERVE_DOCUMENTS if d[1]["kind"] == "ServingRuntime"]
    bad = yaml.safe_load(yaml.safe_dump(runtime))
    bad["spec"]["protocolVersion"] = ["v2"]  # the field is protocolVersions
    bad["spec"]["containers"][0]["argz"] = []  # unknown Container field
    bad["spec"]["supportedModelFormats"][0]["autoSelect"] = "yes"
    messages = [e.message for e in kserve_validator("ServingRuntime").iter_errors(bad)]
    assert len(messages) == 3, messages


# -- agreement with trionserve ----------------------------------------------------


ALL = K8S_DOCUMENTS + KSERVE_DOCUMENTS


@pytest.mark.parametrize("name, document", ALL, ids=[n for n, _ in ALL])
def test_container_arguments_are_trionserve_flags(name, document):
    parser = build_parser()
    for container in containers(document):
        args = container.get("args", [])
        if args:
            parser.parse_args(args)  # exits (SystemExit) on an unknown or bad flag


def _grace_needed(container: dict) -> int:
    """preStop sleep + in-flight drain + model unload, each up to the exit timeout."""
    exit_timeout = float(flag_values(container["args"]).get("--exit-timeout-secs", 30))
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    prestop = float(command[-1]) if command and command[0] == "sleep" else 0
    return int(prestop + 2 * exit_timeout + PRESTOP_MARGIN)


def test_deployment_probes_ports_and_drain():
    ((_, deployment),) = [d for d in K8S_DOCUMENTS if d[1]["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= _grace_needed(container)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_inference_service_grace_period_covers_the_drain():
    ((_, runtime),) = [d for d in KSERVE_DOCUMENTS if d[1]["kind"] == "ServingRuntime"]
    ((_, service),) = [d for d in KSERVE_DOCUMENTS if d[1]["kind"] == "InferenceService"]
    (container,) = runtime["spec"]["containers"]
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    assert service["spec"]["predictor"]["terminationGracePeriodSeconds"] >= _grace_needed(container)
    flags = flag_values(container["args"])
    # KServe's conventions: models in /mnt/models, HTTP on 8080, gRPC on 9000.
    assert (flags["--model-repository"], flags["--http-port"], flags["--grpc-port"]) == (
        "/mnt/models",
        "8080",
        "9000",
    )
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == flags["--metrics-port"]


def test_services_select_the_pods_and_their_ports():
    ((_, deployment),) = [d for d in K8S_DOCUMENTS if d[1]["kind"] == "Deployment"]
    services = {d["metadata"]["name"]: d for _, d in K8S_DOCUMENTS if d["kind"] == "Service"}
    container_ports = {
        p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in services.values():
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
        assert service["spec"]["selector"].items() <= labels.items()
    # The main Service carries all three ports.
    assert {p["targetPort"] for p in services["trionserve"]["spec"]["ports"]} == container_ports


def test_autoscaler_metrics_come_from_the_adapter_rules():
    ((_, hpa),) = [d for d in K8S_DOCUMENTS if d[1]["kind"] == "HorizontalPodAutoscaler"]
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted and wanted <= served
    # The rules read Triton's metric names, as trionserve exports them.
    queried = {re.match(r"(\w+)\{", rule["seriesQuery"]).group(1) for rule in rules}
    assert queried == {"nv_inference_queue_duration_us", "nv_inference_pending_request_count"}
