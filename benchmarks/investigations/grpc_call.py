"""The gRPC transport's own work for one unary ModelInfer call, without sockets or Trio.

Usage: python -m benchmarks.investigations.grpc_call [--calls 20000] [--rounds 7]

An h2 client connection (as a gRPC client sends it: request headers, indexed by
HPACK after the first call, and one DATA frame with the message) makes the bytes
of a ``simple`` ModelInfer call; the server side is the transport's own h2
connection (trionserve.protocol.grpc.upstream.H2Connection, configured as the
transport configures it), which parses them and frames the answer: response
headers, the message, the OK trailers. Measured apart, on the same bytes: the
server's h2 receive, its h2 send, and the codec (decode the request message,
encode the response); and the h2 receive again with hpack's own decoder instead
of the transport's (which keeps the header lists of repeated blocks). The rounds
interleave; the median µs per call of each is reported. Compare with the whole
server's CPU per call in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import h2.config
import h2.connection
import h2.events
import hpack
import numpy as np

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.inference import InferenceResponse, Tensor
from trionserve.protocol.grpc import codec, framing, upstream

PATH = b"/inference.GRPCInferenceService/ModelInfer"
REQUEST_HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", PATH),
    (b":authority", b"127.0.0.1:8001"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-c++/1.67.1 grpc-c/44.0.0 (linux; chttp2)"),
    (b"grpc-accept-encoding", b"identity, deflate, gzip"),
]


def request_message() -> bytes:
    """A ModelInferRequest for ``simple``, as perf_analyzer sends it."""
    message = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        message.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    body = message.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _client() -> h2.connection.H2Connection:
    client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    client.initiate_connection()
    return client


def _server(keep_headers: bool) -> upstream.H2Connection:
    server = upstream.H2Connection(
        framing.CONSTANT_HEADERS,
        h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        ),
        [PATH],  # the transport holds a unary call's stream apart from h2's
    )
    if not keep_headers:  # hpack's own decoder, for comparison
        plain = hpack.Decoder()
        plain.max_header_list_size = server.decoder.max_header_list_size
        plain.max_allowed_table_size = server.decoder.max_allowed_table_size
        server.decoder = plain
    server.initiate_connection()
    return server


def calls(count: int, keep_headers: bool = True) -> tuple[float, float, float]:
    """µs per call: the server's h2 receive, its h2 send, and the codec.
    ``keep_headers``: the transport's decoder (upstream.CachingDecoder), else
    hpack's own."""
    client, server = _client(), _server(keep_headers)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    message = request_message()
    response = InferenceResponse(
        "simple",
        "1",
        outputs=[
            Tensor("OUTPUT0", "INT32", np.arange(16, dtype=np.int32).reshape(1, 16)),
            Tensor("OUTPUT1", "INT32", np.zeros((1, 16), np.int32)),
        ],
    )
    receiving = sending = coding = 0.0
    clock = time.perf_counter
    for _ in range(count):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST_HEADERS)
        client.send_data(stream_id, message, end_stream=True)
        incoming = client.data_to_send()

        t0 = clock()
        data = b""
        for event in server.receive_data(incoming):
            if type(event) is h2.events.DataReceived:
                data = event.data
                server.acknowledge_received_data(event.flow_controlled_length, stream_id)
        t1 = clock()
        request = codec.decode_infer_request(data[5:])
        chunks = codec.encode_infer_response(response, request)
        t2 = clock()
        body = b"".join(chunks)
        server.send_headers(stream_id, framing.RESPONSE_HEADERS)
        framed = b"\x00" + len(body).to_bytes(4, "big") + body
        if not server.send_whole(stream_id, framed):  # as the transport sends it
            server.send_data(stream_id, framed)
        server.send_headers(stream_id, framing.OK_TRAILERS, end_stream=True)
        outgoing = server.buffers_to_send()
        t3 = clock()

        for event in client.receive_data(b"".join(outgoing)):
            if type(event) is h2.events.DataReceived:
                client.acknowledge_received_data(event.flow_controlled_length, stream_id)
        receiving += t1 - t0
        coding += t2 - t1
        sending += t3 - t2
    scale = 1e6 / count
    return receiving * scale, sending * scale, coding * scale


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    calls(500)  # warm-up
    rounds, plain = [], []
    for _ in range(args.rounds):
        rounds.append(calls(args.calls))
        plain.append(calls(args.calls, keep_headers=False))
    names = ("h2 receive (request headers + message)", "h2 send (headers, message, trailers)")
    names += ("codec (decode request, encode response)",)
    print(f"{'':<42} µs per call (median of {args.rounds} rounds of {args.calls})")
    for index, name in enumerate(names):
        print(f"{name:<42} {statistics.median(r[index] for r in rounds):6.1f}")
    print(f"{'total':<42} {statistics.median(sum(r) for r in rounds):6.1f}")
    print(
        f"{'h2 receive, hpack.Decoder (none kept)':<42} "
        f"{statistics.median(r[0] for r in plain):6.1f}"
    )


if __name__ == "__main__":
    main()
