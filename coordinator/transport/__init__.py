"""The gRPC edge: agent streams in (``server``), protobuf to and from the core's events
(``wire``), what is refused at the edge (``checks``), the TLS identity (``tls``)."""
