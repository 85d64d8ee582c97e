"""The response cache (``--cache-config local,size=N`` with ``response_cache``):
identical requests are answered from memory over HTTP and gRPC, with Triton's
statistics and metrics; the cache itself, on its own."""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess, free_port, http_client, scrape_metrics, serving
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.core.response_cache import ResponseCache, parse_cache_config

# Answers X + executions so far: a response from the cache shows an old count.
COUNTER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.executions += 1
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input")))
                continue
            out = np.array([self.executions], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("COUNT", out), pb_utils.Tensor("Y", x * 2)]))
        return responses
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 2 ] }} ]
output [
  {{ name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }}
]
response_cache {{ enable: {enable} }}
"""


# An ensemble over the cached model: its step requests meet the cache too.
ENSEMBLE = """
name: "ens_cached"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "cached" model_version: -1
  input_map { key: "X" value: "X" } output_map { key: "COUNT" value: "COUNT" } } ] }
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    for name, enable in (("cached", "true"), ("uncached", "false")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, enable=enable))
        (root / name / "1" / "model.py").write_text(textwrap.dedent(COUNTER))
    (root / "ens_cached" / "1").mkdir(parents=True)
    (root / "ens_cached" / "config.pbtxt").write_text(ENSEMBLE)
    return root


@pytest.fixture(scope="module")
def server(repository):
    with serving(repository, args=["--cache-config", "local,size=1048576"]) as proc:
        yield proc


def call(client, module, model: str, values) -> tuple[int, list[int]]:
    x = module.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array(values, dtype=np.int32))
    result = client.infer(model, [x])
    return int(result.as_numpy("COUNT")[0]), result.as_numpy("Y").tolist()


def stats(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def test_identical_requests_are_answered_from_the_cache(server):
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert call(http, httpclient, "cached", [1, 2]) == (1, [2, 4])
        assert call(http, httpclient, "cached", [1, 2]) == (1, [2, 4])  # hit
        assert call(grpc, grpcclient, "cached", [1, 2]) == (1, [2, 4])  # hit, over gRPC
        assert call(http, httpclient, "cached", [3, 4]) == (2, [6, 8])  # other input
        # Errors are not cached: the model runs each time.
        for _ in range(2):
            with pytest.raises(InferenceServerException, match="negative input"):
                call(http, httpclient, "cached", [-1, 0])
        # A model without response_cache always runs.
        assert call(http, httpclient, "uncached", [1, 2]) == (1, [2, 4])
        assert call(http, httpclient, "uncached", [1, 2]) == (2, [2, 4])
        cached = stats(http, "cached")
    finally:
        http.close()
        grpc.close()
    inference = cached["inference_stats"]
    assert inference["cache_hit"]["count"] == 2
    assert inference["cache_miss"]["count"] == 4
    assert inference["success"]["count"] == 4  # hits are successes
    assert cached["inference_count"] == 2  # ... but not inferences
    assert inference["fail"]["count"] == 2

    families = scrape_metrics(server)
    (hits,) = families["nv_cache_num_hits_per_model"].samples
    assert (hits.labels["model"], hits.value) == ("cached", 2)
    (misses,) = families["nv_cache_num_misses_per_model"].samples
    assert misses.value == 4


def test_ensemble_steps_and_grpc_streams_meet_the_cache(server):
    """Triton's schedulers consult the cache for every request of a model with
    it (core src/dynamic_batch_scheduler.cc), an ensemble's step requests and a
    gRPC stream's among them (qa/L0_response_cache
    test_ensemble_composing_model_cache_enabled)."""
    http = httpclient.InferenceServerClient(server.http_url)
    before = stats(http, "cached")["inference_stats"]
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([70, 80], dtype=np.int32))
    first = http.infer("ens_cached", [x]).as_numpy("COUNT").tolist()
    assert http.infer("ens_cached", [x]).as_numpy("COUNT").tolist() == first  # from the cache
    after = stats(http, "cached")["inference_stats"]
    assert after["cache_miss"]["count"] - before["cache_miss"].get("count", 0) == 1
    assert after["cache_hit"]["count"] - before["cache_hit"].get("count", 0) == 1

    results: list = []
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    grpc.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        g = grpcclient.InferInput("X", [2], "INT32")
        g.set_data_from_numpy(np.array([70, 80], dtype=np.int32))
        # The ensemble's step asked for COUNT alone: the same request.
        grpc.async_stream_infer("cached", [g], outputs=[grpcclient.InferRequestedOutput("COUNT")])
    finally:
        grpc.stop_stream()  # waits for the stream's responses
        grpc.close()
    ((result, error),) = results
    assert error is None and result.as_numpy("COUNT").tolist() == first  # a hit
    final = stats(http, "cached")["inference_stats"]
    http.close()
    assert final["cache_hit"]["count"] == after["cache_hit"]["count"] + 1


def test_a_response_larger_than_the_cache_is_answered_and_its_insert_logged(repository):
    # 2 outputs packed as Triton packs them (core cache_entry.cc): the count (4),
    # then each output's size (8), name, datatype, shape (each with a 4-byte
    # length), data size (8) and data: COUNT 8+9+9+12+8+8 = 54, Y 8+5+9+12+8+8 =
    # 50; 108 bytes in all.
    with serving(repository, args=["--cache-config", "local,size=107"]) as proc:
        with http_client(proc) as client:
            assert call(client, httpclient, "cached", [1, 2]) == (1, [2, 4])
            assert call(client, httpclient, "cached", [1, 2]) == (2, [2, 4])  # not kept
        output = proc.output()
    assert "Failed to insert key [" in output
    assert "Requested byte_size: 108 is greater than total cache size: 107" in output


def test_without_a_cache_config_nothing_is_cached(repository):
    with serving(repository) as proc, http_client(proc) as client:
        assert call(client, httpclient, "cached", [1, 2])[0] == 1
        assert call(client, httpclient, "cached", [1, 2])[0] == 2
        assert stats(client, "cached")["inference_stats"]["cache_hit"]["count"] == 0


# -- the cache on its own ----------------------------------------------------------------


def request(values, *, outputs=None, parameters=None, datatype="INT32") -> InferenceRequest:
    data = np.array(values, dtype=np.int32 if datatype == "INT32" else np.uint32)
    return InferenceRequest(
        "m",
        1,
        inputs={"X": Tensor("X", datatype, data)},
        requested_outputs=[RequestedOutput(o) for o in outputs] if outputs else None,
        parameters=parameters or {},
    )


def test_the_key_covers_what_changes_the_answer():
    key = ResponseCache.key
    base = key("m", 1, request([1, 2]))
    assert key("m", 1, request([1, 2])) == base
    assert key("m", 1, request([1, 2], parameters={"binary_data_output": True})) == base
    different = [
        key("m", 2, request([1, 2])),
        key("n", 1, request([1, 2])),
        key("m", 1, request([1, 3])),
        key("m", 1, request([[1, 2]])),
        key("m", 1, request([1, 2], datatype="UINT32")),
        key("m", 1, request([1, 2], outputs=["Y"])),
        key("m", 1, request([1, 2], parameters={"temperature": 0.5})),
    ]
    assert base not in different and len(set(different)) == len(different)


def response(nbytes: int) -> InferenceResponse:
    return InferenceResponse("m", "1", "", [Tensor("Y", "UINT8", np.zeros(nbytes, np.uint8))])


def test_least_recently_used_entries_make_room():
    cache = ResponseCache(3000)
    keys = [bytes([i]) * 32 for i in range(3)]
    for k in keys:
        cache.insert(k, response(900))
    assert len(cache) == 3
    assert cache.lookup(keys[0], request([1]), "1") is not None  # now most recent
    cache.insert(b"\x09" * 32, response(900))
    assert cache.lookup(keys[1], request([1]), "1") is None  # evicted
    assert cache.lookup(keys[0], request([1]), "1") is not None
    assert cache.evictions == 1 and cache.used <= 3000
    cache.insert(b"\x0a" * 32, response(5000))  # larger than the cache: not kept
    assert cache.lookup(b"\x0a" * 32, request([1]), "1") is None
    hit = cache.lookup(keys[0], request([1]), "1")
    assert hit.outputs[0].data.flags.writeable is False


def test_cache_config_parsing():
    assert parse_cache_config([], None) == 0
    assert parse_cache_config(["local,size=1024"], None) == 1024
    assert parse_cache_config([], 2048) == 2048
    for bad, message in (
        (["memcached,size=1"], "the caches are 'local' and 'redis'"),
        (["local,bytes=1"], "unknown setting 'bytes'"),
        (["local,size=lots"], "size must be a number"),
        # Triton's words and order (command_line_parser.cc, core server.cc Init).
        (["local,size=1", "redis,host=h"], "found multiple cache configurations"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            parse_cache_config(bad, None)
    with pytest.raises(InvalidArgument, match="Incompatible flags --response-cache-byte-size"):
        parse_cache_config(["local,size=1"], 1)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (skipped where none is
    installed: it is a system package, e.g. Debian's redis-server)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(500):  # its socket is up within milliseconds
            try:
                client.ping()
                break
            except redis.ConnectionError:
                proc.wait(0.01) if proc.poll() is not None else None
        yield port, client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def _redis_args(port: int, *extra: str) -> list[str]:
    return [
        "--cache-config",
        "redis,host=127.0.0.1",
        "--cache-config",
        f"redis,port={port}",
        *extra,
    ]


def test_the_redis_cache_keeps_responses_in_redis_as_tritons_plugin_does(repository, redis_server):
    port, client = redis_server
    with serving(repository, args=_redis_args(port)) as proc, http_client(proc) as http:
        assert call(http, httpclient, "cached", [5, 6]) == (1, [10, 12])
        assert call(http, httpclient, "cached", [5, 6]) == (1, [10, 12])  # from Redis
        inference = stats(http, "cached")["inference_stats"]
    assert inference["cache_hit"]["count"] == 1 and inference["cache_miss"]["count"] == 1
    (key,) = client.keys()
    # The redis_cache plugin's hash (src/cache_api.cc): buffer 0, its size, CPU memory.
    entry = client.hgetall(key)
    assert sorted(entry) == [b"0:b", b"0:i", b"0:s", b"0:t"]
    assert int(entry[b"0:s"]) == len(entry[b"0:b"]) == 108  # core's packing, as above
    assert (entry[b"0:t"], entry[b"0:i"]) == (b"0", b"0")


@pytest.mark.parametrize(
    ("setup", "args", "env", "expected"),
    [
        (
            None,
            ["redis,port=notaport"],
            {},
            "failed to connect to Redis (127.0.0.1:0): Connection refused",
        ),
        ("secret", [], {}, "Failed to initialize RedisCache: NOAUTH Authentication required"),
        ("secret", ["redis,password=wrong"], {}, "Failed to initialize RedisCache: WRONGPASS"),
        ("secret", [], {"TRITONCACHE_REDIS_PASSWORD": "wrong"}, "WRONGPASS"),
    ],
)
def test_a_redis_cache_the_server_cannot_use_stops_it_with_the_plugins_words(
    tmp_path, redis_server, setup, args, env, expected
):
    port, client = redis_server
    if setup is not None:
        client.config_set("requirepass", setup)
    flags = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}"]
    for setting in args:
        flags += ["--cache-config", setting]
    proc = ServerProcess(tmp_path, args=flags, env=env)
    try:
        assert proc.wait_exit(60) == 1
        assert expected in proc.output()
    finally:
        proc.close()
