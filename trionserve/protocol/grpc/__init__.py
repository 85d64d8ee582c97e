"""gRPC frontend: ``inference.GRPCInferenceService`` on HTTP/2 (h2) over Trio sockets.

``codec`` turns protobuf messages into core requests and back (pure), ``framing``
the gRPC message framing, ``connection`` one HTTP/2 connection, ``transport`` the
listener, ``service`` the RPC handlers over the DataPlane."""
