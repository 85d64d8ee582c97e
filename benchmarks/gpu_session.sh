#!/usr/bin/env bash
# One GPU session in one command: the GPU tests, then the served-vs-direct GPU
# matrix, every result written to one folder (about 8 minutes on one GPU).
#
#   benchmarks/gpu_session.sh [--gpu auto|off] [--wheels DIR] [--quick] OUT_DIR
#
# Run from anywhere; it works in the checkout it belongs to. The host needs python
# (3.11+) with torch, and for the full matrix torchvision, onnxruntime-gpu, cupy,
# nvidia-ml-py and pytest. --wheels DIR (or TRIONSERVE_WHEELS=DIR): a folder of
# wheels for what the host lacks (trio, httptools, h2, structlog, tritonclient, ...),
# installed offline, without their dependencies, into OUT_DIR's scratch folder.
# --gpu off runs the same steps with the GPU ones skipped or on the CPU (a check of
# the script itself); --quick shortens the benchmark points.
#
# Written to OUT_DIR: env.txt (versions, what is missing), nvidia-smi.txt,
# pytest.log and junit-gpu.xml (the tests), served_vs_direct.md (the benchmark's
# log and table), summary.txt (each step's exit status and time).
set -u -o pipefail

gpu=auto
wheels=${TRIONSERVE_WHEELS:-}
quick=0
out=
while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) gpu=$2; shift 2 ;;
        --gpu=*) gpu=${1#*=}; shift ;;
        --wheels) wheels=$2; shift 2 ;;
        --wheels=*) wheels=${1#*=}; shift ;;
        --quick) quick=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) out=$1; shift ;;
    esac
done
if [ -z "$out" ]; then
    echo "usage: $0 [--gpu auto|off] [--wheels DIR] [--quick] OUT_DIR" >&2
    exit 2
fi
case "$gpu" in auto|off) ;; *) echo "--gpu is auto or off" >&2; exit 2 ;; esac

repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/trionserve-gpu-session.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
python=${PYTHON:-python3}
summary=$out/summary.txt
: >"$summary"
export PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT_S COMMAND...: run it, note its status and time
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    echo "== $name" >&2
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "$name: rc=$rc $(( $(date +%s) - started ))s" | tee -a "$summary" >&2
    return 0
}

# -- 1. the environment ----------------------------------------------------------------
if [ -n "$wheels" ]; then
    step "install wheels" 120 "$python" -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$scratch/site" "$wheels"/*.whl
    export PYTHONPATH=$repo:$scratch/site${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$gpu" = off ]; then
    export CUDA_VISIBLE_DEVICES=  # the server and the tests see no GPU
    echo "GPU off: CUDA_VISIBLE_DEVICES is empty" >"$out/nvidia-smi.txt"
elif command -v nvidia-smi >/dev/null; then
    { nvidia-smi; nvidia-smi -q; } >"$out/nvidia-smi.txt" 2>&1
else
    echo "nvidia-smi: not found" >"$out/nvidia-smi.txt"
fi
step "environment" 120 "$python" - >"$out/env.txt" 2>&1 <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
missing = []
for module in ("trio", "httptools", "h2", "hpack", "hyperframe", "structlog",
               "prometheus_client", "google.protobuf", "numpy", "onnxruntime", "pytest",
               "pytest_trio", "pytest_timeout", "h11", "hypothesis", "tritonclient.http",
               "tritonclient.grpc", "tritonclient.utils.cuda_shared_memory", "grpc", "onnx",
               "torch", "torchvision", "cupy", "pynvml", "tensorrt"):
    try:
        found = importlib.import_module(module)
        print(f"{module:<18} {getattr(found, '__version__', 'ok')}")
    except Exception as exc:
        missing.append(module)
        print(f"{module:<18} MISSING ({type(exc).__name__}: {str(exc)[:100]})")
try:
    import torch
    print("torch CUDA", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
except Exception:
    pass
try:
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers())
except Exception:
    pass
print("missing:", ", ".join(missing) or "nothing")
EOF
cat "$out/env.txt" >&2

# -- 2. the GPU tests (they skip, with the reason, what this host cannot run) ----------
cd "$repo" || exit 1
step "tests" 210 "$python" -m pytest -q -p no:cacheprovider -o junit_family=xunit2 \
    --junitxml="$out/junit-gpu.xml" -rs \
    tests/e2e/test_gpu.py tests/unit/test_gpu_paths.py tests/e2e/test_cuda_shared_memory.py \
    tests/e2e/test_pytorch_backend.py tests/unit/test_executor_pipeline.py \
    >"$out/pytest.log" 2>&1
tail -n 30 "$out/pytest.log" >&2

# -- 3. served vs direct: resnet50 (TorchScript, graphs off and on; ONNX Runtime CUDA)
#       over HTTP, gRPC and CUDA shared memory at c=1, 16, 32 ----------------------------
if [ "$quick" = 1 ]; then timing=(--duration 1 --warmup 0.5); else timing=(--duration 3 --warmup 1); fi
if [ "$gpu" = off ]; then
    matrix=(--gpu off --models cnn_onnx,cnn_torch --paths http,grpc --concurrency 1,16)
else
    matrix=(--models resnet50_torch,resnet50_onnx --graphs --paths http,grpc,cuda_shm
            --concurrency 1,16,32)
fi
step "served_vs_direct" 360 "$python" -m benchmarks.served_vs_direct "${matrix[@]}" \
    "${timing[@]}" >"$out/served_vs_direct.md" 2>&1
tail -n 40 "$out/served_vs_direct.md" >&2

if [ "$gpu" != off ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi >>"$out/nvidia-smi.txt" 2>&1
fi
echo "results in $out:" >&2
cat "$summary" >&2
