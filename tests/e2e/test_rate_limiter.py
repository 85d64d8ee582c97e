"""--rate-limit and --rate-limit-resource end to end: the trionserve command, Python
models, tritonclient.

The Python models count, in a file shared by their stub processes (under a file
lock), how many of their executions are inside ``execute`` at once. Each execution
waits there for a partner (up to a bound), so executions that are allowed to
overlap do, and the count shows whether the rate limiter let them.
"""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.repository import python_model
from tests.serverproc import ServerProcess, serving

MODEL = textwrap.dedent(
    """
    import fcntl
    import json
    import time

    import triton_python_backend_utils as pb_utils

    COUNTER = {counter!r}


    def update(change):
        with open(COUNTER, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            inside, most = json.loads(f.read() or "[0, 0]")
            inside += change
            most = max(most, inside)
            f.seek(0)
            f.truncate()
            f.write(json.dumps([inside, most]))
            return inside


    class TritonPythonModel:
        def execute(self, requests):
            inside = update(1)
            deadline = time.monotonic() + 0.3
            while inside < 2 and time.monotonic() < deadline:
                time.sleep(0.005)  # a partner may join, if it is allowed to
                inside = update(0)
            update(-1)
            responses = []
            for request in requests:
                data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
            return responses
    """
)


def counting_model(root: Path, name: str, rate_limiter: str, counter: Path) -> None:
    """A Python model that counts its executions running at once in ``counter``."""
    python_model(
        root,
        name,
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        f"instance_group [ {{ count: 1 kind: KIND_CPU {rate_limiter} }} ]\n",
        MODEL.format(counter=str(counter)),
    )


@pytest.fixture
def repository(tmp_path):
    counter = tmp_path / "counter.json"
    counter.write_text("[0, 0]")
    root = tmp_path / "models"
    limited = 'rate_limiter { resources [ { name: "R1" count: 1 } ] }'
    counting_model(root, "a", limited, counter)
    counting_model(root, "b", limited, counter)
    return root, counter


def infer_both(proc: ServerProcess, each: int = 2) -> None:
    def one(model: str) -> None:
        client = httpclient.InferenceServerClient(proc.http_url, network_timeout=60)
        try:
            data = np.ones([1], dtype=np.float32)
            infer_input = httpclient.InferInput("INPUT0", [1], "FP32")
            infer_input.set_data_from_numpy(data)
            result = client.infer(model, [infer_input]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(result, data)
        finally:
            client.close()

    with ThreadPoolExecutor(2 * each) as pool:
        list(pool.map(one, ["a", "b"] * each))


@pytest.mark.parametrize(
    ("args", "most"),
    [
        (["--rate-limit=execution_count"], 1),
        (["--rate-limit=execution_count", "--rate-limit-resource=R1:2"], 2),
        (["--rate-limit=off"], 2),
    ],
    ids=["limited", "two-copies", "off"],
)
def test_models_sharing_a_resource_overlap_only_within_its_count(repository, args, most):
    root, counter = repository
    with serving(root, args=args) as proc:
        infer_both(proc)
    assert counter.read_text() == f"[0, {most}]"


def test_a_resource_count_below_a_models_need_fails_the_start(tmp_path):
    # qa/L0_rate_limiter "Case1": the model needs 4, the server was given 1.
    counter = tmp_path / "counter.json"
    counting_model(
        tmp_path / "models",
        "a",
        'rate_limiter { resources [ { name: "resource1" count: 4 } ] }',
        counter,
    )
    proc = ServerProcess(
        tmp_path / "models",
        args=["--rate-limit=execution_count", "--rate-limit-resource=resource1:1"],
    )
    try:
        assert proc.wait_exit() == 1
        # In the error record, escaped as Triton escapes a log message.
        assert (
            'Resource count for \\"resource1\\" is limited to 1 which will prevent scheduling '
            "of one or more model instances, the minimum required count is 4"
        ) in proc.output()
    finally:
        proc.close()
