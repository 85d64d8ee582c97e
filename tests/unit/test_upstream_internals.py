"""The private parts of h2, hpack, hyperframe and protobuf we rely on are still there.

Each test here fails when an upstream release changes something
``trionserve/protocol/grpc/upstream.py`` or ``trionserve/_generated/protopool.py``
relies on: then adapt that module and raise the version bound in pyproject.toml.
"""

from __future__ import annotations

import inspect

import h2.config
import h2.connection
import h2.events
import hpack
import numpy as np
from google.protobuf.internal import api_implementation, builder
from hyperframe import frame as hyperframe_frame

from trionserve.protocol.grpc import upstream

HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def test_hyperframe_data_repr_is_replaced_with_the_same_text():
    assert hasattr(hyperframe_frame, "_raw_data_repr")
    assert hyperframe_frame.DataFrame._body_repr is upstream._data_frame_repr
    frame = hyperframe_frame.DataFrame(1, data=bytes(range(200)))
    expected = hyperframe_frame._raw_data_repr(frame.data)
    assert upstream._data_frame_repr(frame) == expected
    assert expected in repr(frame)


def test_hpack_header_table_attributes():
    encoder = hpack.Encoder()
    assert encoder.header_table.resized is False
    assert len(encoder.header_table.dynamic_entries) == 0
    encoder.header_table_size = 1024
    assert encoder.header_table.resized is True


def test_cached_header_blocks_decode_to_the_headers():
    encoder = upstream.CachingEncoder([HEADERS])
    block = encoder.encode(HEADERS)
    assert block == upstream._state_free_block(HEADERS)
    assert hpack.Decoder().decode(block, raw=True) == HEADERS


def _connections():
    """An h2 server and client, past the preface and settings exchange."""
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    server = upstream.H2Connection([HEADERS], config)
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(b"".join(bytes(b) for b in server.buffers_to_send()))
    server.receive_data(client.data_to_send())
    client.send_headers(
        1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"), (b":authority", b"a")]
    )
    server.receive_data(client.data_to_send())
    return server, client


def test_h2_private_send_path_still_exists():
    source = inspect.getsource(h2.connection.H2Connection)
    assert "def _prepare_for_sending(self, frames" in source
    assert "self._data_to_send" in source
    # send_data serializes through _prepare_for_sending (our hook sees every frame).
    assert "_prepare_for_sending" in inspect.getsource(h2.connection.H2Connection.send_data)


def test_payload_views_go_out_as_h2_would_write_them():
    server, client = _connections()
    payload = bytes(range(256)) * 64
    server.send_headers(1, HEADERS)
    server.send_data(1, np.frombuffer(payload, np.uint8), end_stream=True)
    wire = b"".join(bytes(b) for b in server.buffers_to_send())
    events = client.receive_data(wire)
    received = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert received == payload
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    headers = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert headers and list(headers[0].headers) == HEADERS


def test_protobuf_symbol_database_hook():
    assert hasattr(builder, "_sym_db")
    assert api_implementation.Type() in ("python", "upb", "cpp")
    assert "_sym_db" in inspect.getsource(builder.BuildTopDescriptorsAndMessages)
