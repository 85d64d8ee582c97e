"""Schema compatibility of trionserve's .proto files with Triton's.

Every message and enum (nested ones included) in our ``model_config.proto`` and
``grpc_service.proto`` is compared with its tritonclient counterpart: names,
field numbers, types, labels, referenced types, oneofs, map-ness and enum
values.  The service definition is compared method by method, and a few
cross-library wire round trips check byte-for-byte compatibility.

Both libraries define ``inference.*`` messages; ours live in a private
descriptor pool (``trionserve._generated.protopool``), so importing both here in
one process is itself part of what is tested.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.grpc  # noqa: F401  (registers Triton's protos in the default pool)
from google.protobuf import descriptor, json_format, text_format
from tritonclient.grpc import model_config_pb2 as triton_mc
from tritonclient.grpc import service_pb2 as triton_sv

from trionserve._generated import grpc_service_pb2 as our_sv
from trionserve._generated import model_config_pb2 as our_mc
from trionserve._generated.protopool import POOL

REPO_ROOT = Path(__file__).resolve().parents[2]

FILE_PAIRS = [
    pytest.param(our_mc.DESCRIPTOR, triton_mc.DESCRIPTOR, id="model_config"),
    pytest.param(our_sv.DESCRIPTOR, triton_sv.DESCRIPTOR, id="grpc_service"),
]


# --------------------------------------------------------------------------- #
# Descriptor walking helpers
# --------------------------------------------------------------------------- #


def _walk_messages(file_desc):
    """All message descriptors of a file, nested (and map-entry) ones included."""
    out = {}

    def visit(msg):
        out[msg.full_name] = msg
        for nested in msg.nested_types:
            visit(nested)

    for msg in file_desc.message_types_by_name.values():
        visit(msg)
    return out


def _walk_enums(file_desc):
    """All enum descriptors of a file, top-level and nested."""
    out = {e.full_name: e for e in file_desc.enum_types_by_name.values()}
    for msg in _walk_messages(file_desc).values():
        for enum in msg.enum_types:
            out[enum.full_name] = enum
    return out


_TYPE_NAMES = {
    value: name[len("TYPE_") :].lower()
    for name, value in vars(descriptor.FieldDescriptor).items()
    if name.startswith("TYPE_") and isinstance(value, int)
}


def _label(field) -> str:
    if getattr(field, "is_repeated", None) is not None:
        if field.is_repeated:
            return "repeated"
        return "required" if field.is_required else "optional"
    return {1: "optional", 2: "required", 3: "repeated"}[field.label]  # old runtimes


def _is_map(field) -> bool:
    return bool(
        field.message_type is not None
        and field.message_type.GetOptions().map_entry
        and _label(field) == "repeated"
    )


def _field_signature(field) -> dict:
    """Everything about a field that affects wire, JSON or text-format compatibility."""
    oneof = field.containing_oneof
    return {
        "name": field.name,
        "number": field.number,
        "type": _TYPE_NAMES.get(field.type, field.type),
        "label": _label(field),
        "message_type": field.message_type.full_name if field.message_type else None,
        "enum_type": field.enum_type.full_name if field.enum_type else None,
        "oneof": oneof.name if oneof is not None else None,
        "map": _is_map(field),
        "json_name": field.json_name,
        "has_presence": field.has_presence,
    }


def _message_mismatches(ours, theirs) -> list[str]:
    """Human-readable differences between two message descriptors (empty if none)."""
    where = ours.full_name
    problems = []
    if ours.full_name != theirs.full_name:
        problems.append(f"{where}: full name differs from Triton's {theirs.full_name}")
    if bool(ours.GetOptions().map_entry) != bool(theirs.GetOptions().map_entry):
        problems.append(f"{where}: map_entry option differs")

    our_fields = {f.name: f for f in ours.fields}
    their_fields = {f.name: f for f in theirs.fields}
    for name in their_fields.keys() - our_fields.keys():
        problems.append(
            f"{where}: missing field '{name}' (Triton number {their_fields[name].number})"
        )
    for name in our_fields.keys() - their_fields.keys():
        problems.append(f"{where}: extra field '{name}' not in Triton's schema")
    for name in sorted(
        our_fields.keys() & their_fields.keys(), key=lambda n: their_fields[n].number
    ):
        a, b = _field_signature(our_fields[name]), _field_signature(their_fields[name])
        for key in a:
            if a[key] != b[key]:
                problems.append(f"{where}.{name}: {key} is {a[key]!r}, Triton has {b[key]!r}")

    our_numbers = sorted(f.number for f in ours.fields)
    if len(our_numbers) != len(set(our_numbers)):
        problems.append(f"{where}: duplicate field numbers {our_numbers}")

    our_oneofs = {o.name: sorted(f.name for f in o.fields) for o in ours.oneofs}
    their_oneofs = {o.name: sorted(f.name for f in o.fields) for o in theirs.oneofs}
    if our_oneofs != their_oneofs:
        problems.append(f"{where}: oneofs are {our_oneofs}, Triton has {their_oneofs}")

    our_nested = sorted(m.name for m in ours.nested_types)
    their_nested = sorted(m.name for m in theirs.nested_types)
    if our_nested != their_nested:
        problems.append(f"{where}: nested messages are {our_nested}, Triton has {their_nested}")
    our_enums = sorted(e.name for e in ours.enum_types)
    their_enums = sorted(e.name for e in theirs.enum_types)
    if our_enums != their_enums:
        problems.append(f"{where}: nested enums are {our_enums}, Triton has {their_enums}")
    return problems


def _enum_mismatches(ours, theirs) -> list[str]:
    where = ours.full_name
    problems = []
    if ours.full_name != theirs.full_name:
        problems.append(f"{where}: full name differs from Triton's {theirs.full_name}")
    our_values = [(v.name, v.number) for v in ours.values]
    their_values = [(v.name, v.number) for v in theirs.values]
    if sorted(our_values) != sorted(their_values):
        missing = sorted(set(their_values) - set(our_values))
        extra = sorted(set(our_values) - set(their_values))
        problems.append(f"{where}: enum values differ; missing {missing}, extra {extra}")
    return problems


def _fail_on_first(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more: {problems[1:6]})" if len(problems) > 1 else ""
        pytest.fail(f"{what}: first mismatch: {problems[0]}{more}", pytrace=False)


# --------------------------------------------------------------------------- #
# Schema comparison
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("ours,theirs", FILE_PAIRS)
def test_file_level_properties(ours, theirs):
    assert ours.package == theirs.package == "inference"
    assert ours.pool is POOL, "our generated module must register in the private pool"
    assert theirs.pool is not POOL
    assert not ours.GetOptions().ListFields(), "Triton's files set no file options"


def _all_pairs():
    """(kind, full_name) for every message and enum in either side's files."""
    ids = []
    for ours, theirs in (
        (our_mc.DESCRIPTOR, triton_mc.DESCRIPTOR),
        (our_sv.DESCRIPTOR, triton_sv.DESCRIPTOR),
    ):
        for name in sorted(_walk_messages(ours).keys() | _walk_messages(theirs).keys()):
            ids.append(("message", ours.name, name))
        for name in sorted(_walk_enums(ours).keys() | _walk_enums(theirs).keys()):
            ids.append(("enum", ours.name, name))
    return ids


_OUR_FILES = {
    our_mc.DESCRIPTOR.name: (our_mc.DESCRIPTOR, triton_mc.DESCRIPTOR),
    our_sv.DESCRIPTOR.name: (our_sv.DESCRIPTOR, triton_sv.DESCRIPTOR),
}


@pytest.mark.parametrize(
    "kind,file_name,full_name",
    _all_pairs(),
    ids=lambda v: v.rsplit("/", 1)[-1] if isinstance(v, str) else v,
)
def test_type_matches_triton(kind, file_name, full_name):
    ours_file, theirs_file = _OUR_FILES[file_name]
    walk = _walk_messages if kind == "message" else _walk_enums
    ours = walk(ours_file).get(full_name)
    theirs = walk(theirs_file).get(full_name)
    if theirs is None:
        pytest.fail(
            f"{kind} {full_name} is in our {file_name} but not in Triton's {theirs_file.name}",
            pytrace=False,
        )
    if ours is None:
        pytest.fail(
            f"{kind} {full_name} from Triton's {theirs_file.name} is missing in our {file_name}",
            pytrace=False,
        )
    problems = (
        _message_mismatches(ours, theirs) if kind == "message" else _enum_mismatches(ours, theirs)
    )
    _fail_on_first(problems, f"{kind} {full_name}")


@pytest.mark.parametrize("ours,theirs", FILE_PAIRS)
def test_no_missing_or_extra_types(ours, theirs):
    for what, walk in (("message", _walk_messages), ("enum", _walk_enums)):
        our_names, their_names = set(walk(ours)), set(walk(theirs))
        missing = sorted(their_names - our_names)
        extra = sorted(our_names - their_names)
        assert not missing, f"{what}s of Triton's {theirs.name} missing in ours: {missing}"
        assert not extra, f"{what}s in our {ours.name} that Triton lacks: {extra}"


def test_everything_was_compared():
    """Guard against the walkers silently finding nothing."""
    messages = len(_walk_messages(our_mc.DESCRIPTOR)) + len(_walk_messages(our_sv.DESCRIPTOR))
    enums = len(_walk_enums(our_mc.DESCRIPTOR)) + len(_walk_enums(our_sv.DESCRIPTOR))
    triton_messages = len(_walk_messages(triton_mc.DESCRIPTOR)) + len(
        _walk_messages(triton_sv.DESCRIPTOR)
    )
    triton_enums = len(_walk_enums(triton_mc.DESCRIPTOR)) + len(_walk_enums(triton_sv.DESCRIPTOR))
    assert messages == triton_messages and messages >= 100, (messages, triton_messages)
    assert enums == triton_enums and enums >= 9, (enums, triton_enums)
    for name in (
        "inference.ModelConfig",
        "inference.ModelSequenceBatching.StrategyOldest",
        "inference.ModelInstanceGroup.SecondaryDevice",
        "inference.ModelMetrics.MetricControl",
    ):
        assert name in _walk_messages(our_mc.DESCRIPTOR), name
    for name in (
        "inference.ModelInferRequest.InferInputTensor",
        "inference.LogSettingsResponse.SettingValue",
        "inference.ModelStatistics.ResponseStatsEntry",
    ):
        assert name in _walk_messages(our_sv.DESCRIPTOR), name


def test_service_matches_triton():
    assert list(our_sv.DESCRIPTOR.services_by_name) == ["GRPCInferenceService"]
    ours = our_sv.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_sv.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    our_methods = {m.name: m for m in ours.methods}
    their_methods = {m.name: m for m in theirs.methods}
    problems = [f"missing rpc {n}" for n in their_methods if n not in our_methods]
    problems += [f"extra rpc {n}" for n in our_methods if n not in their_methods]
    for name in their_methods.keys() & our_methods.keys():
        a, b = our_methods[name], their_methods[name]
        for attr in ("full_name",):
            if getattr(a, attr) != getattr(b, attr):
                problems.append(f"rpc {name}: {attr} {getattr(a, attr)!r} != {getattr(b, attr)!r}")
        if a.input_type.full_name != b.input_type.full_name:
            problems.append(
                f"rpc {name}: input {a.input_type.full_name} != {b.input_type.full_name}"
            )
        if a.output_type.full_name != b.output_type.full_name:
            problems.append(
                f"rpc {name}: output {a.output_type.full_name} != {b.output_type.full_name}"
            )
        if (a.client_streaming, a.server_streaming) != (b.client_streaming, b.server_streaming):
            problems.append(
                f"rpc {name}: streaming (client, server) {(a.client_streaming, a.server_streaming)} "
                f"!= {(b.client_streaming, b.server_streaming)}"
            )
    _fail_on_first(sorted(problems), "service GRPCInferenceService")
    assert (
        our_methods["ModelStreamInfer"].client_streaming
        and our_methods["ModelStreamInfer"].server_streaming
    )


# --------------------------------------------------------------------------- #
# Wire / format round trips
# --------------------------------------------------------------------------- #


def _triton_infer_request() -> triton_sv.ModelInferRequest:
    req = triton_sv.ModelInferRequest(model_name="simple", model_version="1", id="req-42")
    req.parameters["sequence_id"].int64_param = 7
    req.parameters["priority"].uint64_param = 2**63 + 5
    req.parameters["sequence_start"].bool_param = True
    req.parameters["tag"].string_param = "hello"
    req.parameters["scale"].double_param = 0.25
    inp = req.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 4])
    inp.parameters["shared_memory_region"].string_param = "region0"
    req.inputs.add(name="INPUT1", datatype="BYTES", shape=[2])
    inp2 = req.inputs.add(name="INPUT2", datatype="FP32", shape=[2])
    inp2.contents.fp32_contents.extend([1.5, -2.0])
    out = req.outputs.add(name="OUTPUT0")
    out.parameters["classification"].int64_param = 3
    req.raw_input_contents.append(
        b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00"
    )
    req.raw_input_contents.append(b"\x03\x00\x00\x00abc\x00\x00\x00\x00")
    return req


def test_model_infer_request_round_trip_bytes_equal():
    theirs = _triton_infer_request()
    wire = theirs.SerializeToString(deterministic=True)
    ours = our_sv.ModelInferRequest.FromString(wire)
    assert ours.model_name == "simple" and ours.id == "req-42"
    assert ours.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert ours.parameters["priority"].uint64_param == 2**63 + 5
    assert list(ours.raw_input_contents) == list(theirs.raw_input_contents)
    assert list(ours.inputs[2].contents.fp32_contents) == [1.5, -2.0]
    assert ours.inputs[0].parameters["shared_memory_region"].string_param == "region0"
    assert ours.SerializeToString(deterministic=True) == wire
    # and back again into Triton's class
    assert triton_sv.ModelInferRequest.FromString(ours.SerializeToString()) == theirs


def test_model_infer_response_and_stream_round_trip():
    ours = our_sv.ModelStreamInferResponse()
    resp = ours.infer_response
    resp.model_name, resp.model_version, resp.id = "simple", "1", "r1"
    resp.parameters["triton_final_response"].bool_param = True
    resp.outputs.add(name="OUTPUT0", datatype="INT32", shape=[1, 4])
    resp.raw_output_contents.append(b"\x00" * 16)
    wire = ours.SerializeToString(deterministic=True)
    theirs = triton_sv.ModelStreamInferResponse.FromString(wire)
    assert theirs.infer_response.raw_output_contents[0] == b"\x00" * 16
    assert theirs.infer_response.parameters["triton_final_response"].bool_param is True
    assert theirs.SerializeToString(deterministic=True) == wire


CONFIG_PBTXT = """
name: "seq_model"
backend: "python"
max_batch_size: 8
version_policy { specific { versions: [1, 3] } }
input [
  { name: "INPUT0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, -1, -1]
    reshape { shape: [3, 224, 224] } allow_ragged_batch: true optional: true }
]
output [
  { name: "OUTPUT0" data_type: TYPE_BF16 dims: [-1] label_filename: "labels.txt" }
]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_INT32 source_input: "INPUT0" } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 4 preferred_batch_size: [2, 4] }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] }
  ]
  state [
    { input_name: "IN_STATE" output_name: "OUT_STATE" data_type: TYPE_INT32 dims: [1]
      initial_state [ { name: "init" data_type: TYPE_INT32 dims: [1] zero_data: true } ] }
  ]
}
instance_group [
  { name: "g0" kind: KIND_GPU count: 2 gpus: [0, 1]
    rate_limiter { resources [ { name: "R1" global: true count: 2 } ] priority: 1 }
    secondary_devices [ { kind: KIND_NVDLA device_id: 0 } ] }
]
optimization {
  priority: PRIORITY_MAX
  cuda { graphs: true graph_spec [ { batch_size: 4 input { key: "INPUT0" value { dim: [3, 224, 224] } } } ] }
  execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ] }
}
parameters { key: "EXECUTION_ENV_PATH" value { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
model_warmup [ { name: "w" batch_size: 1 count: 2 inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [3, 8, 8] random_data: true } } } ]
model_transaction_policy { decoupled: true }
response_cache { enable: true }
model_metrics { metric_control [ { metric_identifier { family: "nv_inference_first_response_histogram_ms" }
                                   histogram_options { buckets: [1, 10, 100] } } ] }
"""


def test_config_pbtxt_parses_identically():
    ours = text_format.Parse(CONFIG_PBTXT, our_mc.ModelConfig())
    theirs = text_format.Parse(CONFIG_PBTXT, triton_mc.ModelConfig())
    assert ours.WhichOneof("scheduling_choice") == "sequence_batching"
    assert ours.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    assert ours.instance_group[0].kind == our_mc.ModelInstanceGroup.KIND_GPU
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(
        deterministic=True
    )
    assert json_format.MessageToDict(ours) == json_format.MessageToDict(theirs)
    assert text_format.MessageToString(ours) == text_format.MessageToString(theirs)
    # ModelConfigResponse nests our ModelConfig across the two generated modules
    resp = our_sv.ModelConfigResponse(config=ours)
    parsed = triton_sv.ModelConfigResponse.FromString(resp.SerializeToString())
    assert parsed.config == theirs
    # JSON round trip into our class
    again = json_format.ParseDict(json_format.MessageToDict(theirs), our_mc.ModelConfig())
    assert again == ours


def test_statistics_round_trip():
    stats = our_sv.ModelStatisticsResponse()
    ms = stats.model_stats.add(name="m", version="1", inference_count=10, execution_count=5)
    ms.inference_stats.success.count = 10
    ms.inference_stats.success.ns = 12345
    ms.batch_stats.add(batch_size=2).compute_infer.ns = 99
    ms.memory_usage.add(type="GPU", id=0, byte_size=1024)
    ms.response_stats["0"].success.count = 3
    wire = stats.SerializeToString(deterministic=True)
    theirs = triton_sv.ModelStatisticsResponse.FromString(wire)
    assert theirs.model_stats[0].response_stats["0"].success.count == 3
    assert theirs.SerializeToString(deterministic=True) == wire


@pytest.mark.parametrize("first", ["tritonclient", "trionserve"])
def test_import_order_independent(first):
    """Both libraries' messages coexist in a fresh interpreter, in either import order."""
    a = "import tritonclient.grpc"
    b = (
        "from trionserve._generated import grpc_service_pb2\n"
        "from trionserve._generated import model_config_pb2"
    )
    body = (a + "\n" + b) if first == "tritonclient" else (b + "\n" + a)
    code = body + (
        "\nimport tritonclient.grpc.model_config_pb2 as t\n"
        "c = model_config_pb2.ModelConfig(name='x', max_batch_size=4)\n"
        "assert t.ModelConfig.FromString(c.SerializeToString()).max_batch_size == 4\n"
        "assert grpc_service_pb2.ModelInferRequest.DESCRIPTOR is not "
        "tritonclient.grpc.service_pb2.ModelInferRequest.DESCRIPTOR\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
