#!/usr/bin/env bash
# Regenerate trionserve's protobuf Python modules (messages only, no gRPC stubs).
#
# Usage: scripts/regen_protos.sh        (uses $PYTHON, default "python")
# Needs grpcio-tools. Run from anywhere; it works from the repository root.
#
# The generated modules are post-processed to register their descriptors in
# trionserve._generated.protopool.POOL instead of protobuf's default pool, so
# they can coexist with tritonclient's identically named inference.* messages.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

PROTOS=(
  trionserve/_generated/model_config.proto
  trionserve/_generated/grpc_service.proto
)

"$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "${PROTOS[@]}"

"$PYTHON" - "${PROTOS[@]}" <<'PY'
import sys

# (generated text, replacement) pairs; each generated text must occur exactly once.
REWRITES = [
    ("_descriptor_pool.Default().AddSerializedFile(", "POOL.AddSerializedFile("),
    ("_builder.BuildTopDescriptorsAndMessages(", "build_top_descriptors_and_messages("),
    (
        "from google.protobuf.internal import builder as _builder\n",
        "from google.protobuf.internal import builder as _builder\n"
        "from trionserve._generated.protopool import POOL, build_top_descriptors_and_messages\n",
    ),
]

for proto in sys.argv[1:]:
    path = proto[: -len(".proto")] + "_pb2.py"
    with open(path, encoding="utf-8") as f:
        src = f.read()
    for old, new in REWRITES:
        if src.count(old) != 1:
            sys.exit(f"{path}: expected exactly one {old!r}; cannot redirect to private pool")
        src = src.replace(old, new)
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    print(f"generated {path} (private descriptor pool)")
PY
