"""h11 against httptools on the HTTP/1.1 work of one infer request.

Usage: python -m benchmarks.investigations.http_parser [--requests 20000] [--rounds 7]

The same bytes the synchronous ``tritonclient.http`` client sends for the
``simple`` model (binary INT32 inputs, binary outputs asked for) are parsed, and a
binary answer of the same shape framed, by each library in turn, on one
keep-alive connection: h11 (pure Python; ``next_event`` for the head, the body
and its end, ``send`` for a reused response head, the data and the end) and
httptools (llhttp, in C; the parser's callbacks collect the head and the body,
the answer's head is formatted as the transport formats it). The rounds
interleave; the median µs per request of each is reported. The transport's own
figures (whole server, side by side) are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import h11
import httptools

_HEADER = json.dumps(
    {
        "inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32"}
            | {"parameters": {"binary_data_size": 64}}
            for name in ("INPUT0", "INPUT1")
        ],
        "outputs": [
            {"name": name, "parameters": {"binary_data": True}} for name in ("OUTPUT0", "OUTPUT1")
        ],
    },
    separators=(",", ":"),
).encode()
_BODY = _HEADER + bytes(128)
REQUEST = (
    b"POST /v2/models/simple/infer HTTP/1.1\r\nUser-Agent: python/gevent-http-client-2.6.1\r\n"
    b"Inference-Header-Content-Length: %d\r\nHost: 127.0.0.1:8000\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_HEADER), len(_BODY), _BODY)
)
ANSWER_HEADERS = [
    (b"content-type", b"application/octet-stream"),
    (b"inference-header-content-length", b"200"),
    (b"content-length", b"328"),
]
ANSWER = bytes(328)


def h11_requests(count: int) -> float:
    """µs per request with h11."""
    conn = h11.Connection(h11.SERVER)
    head = h11.Response(status_code=200, headers=ANSWER_HEADERS)  # reused, as before
    start = time.perf_counter()
    for _ in range(count):
        conn.receive_data(REQUEST)
        conn.next_event()  # the head
        parts = []
        while type(event := conn.next_event()) is h11.Data:
            parts.append(event.data)
        out = [conn.send(head)]
        out.extend(conn.send_with_data_passthrough(h11.Data(data=ANSWER)))
        out.append(conn.send(h11.EndOfMessage()))
        b"".join(out)
        conn.start_next_cycle()
    return (time.perf_counter() - start) / count * 1e6


class _Collector:
    """httptools' callbacks, as the transport has them."""

    def __init__(self) -> None:
        self.target = b""
        self.headers: list = []
        self.parts: list = []
        self.complete = False

    def on_message_begin(self) -> None:
        self.target, self.headers, self.parts, self.complete = b"", [], [], False

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_body(self, data: bytes) -> None:
        self.parts.append(data)

    def on_message_complete(self) -> None:
        self.complete = True


def httptools_requests(count: int) -> float:
    """µs per request with httptools."""
    collector = _Collector()
    parser = httptools.HttpRequestParser(collector)
    start = time.perf_counter()
    for _ in range(count):
        parser.feed_data(REQUEST)
        parser.get_method(), parser.get_http_version(), parser.should_keep_alive()
        b"".join(collector.parts)
        lines = [b"HTTP/1.1 200 OK\r\n"]
        lines.extend(b"%s: %s\r\n" % header for header in ANSWER_HEADERS)
        lines.append(b"\r\n")
        b"".join(lines) + ANSWER
    return (time.perf_counter() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="per round and library")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"h11": [], "httptools": []}
    for _ in range(args.rounds):
        results["h11"].append(h11_requests(args.requests))
        results["httptools"].append(httptools_requests(args.requests))
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"{len(REQUEST)}-byte infer request, {args.rounds} interleaved rounds")
    for name, value in medians.items():
        print(f"{name}: {value:.1f} µs per request")
    print(f"httptools / h11: {medians['httptools'] / medians['h11']:.2f}x")


if __name__ == "__main__":
    main()
