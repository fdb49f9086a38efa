"""gRPC serving: `jaxserve serve` — the service and server (server.py), the thread that owns the engine
(engine_loop.py), protobuf <-> engine conversion (convert.py) — its Python client (client.py), Prometheus metrics
(metrics.py) and the API (jaxserve.proto; regenerate the *_pb2* files with generate_proto.sh)."""
