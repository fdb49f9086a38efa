"""Serving: `jaxserve serve` — the gRPC service and server (server.py), the OpenAI-compatible HTTP front end
(openai_http.py, with --http-port), the threads that own the engine and tokenize for both (engine_loop.py),
protobuf <-> engine conversion (convert.py) — its Python client (client.py), Prometheus metrics (metrics.py) and the
gRPC API (jaxserve.proto; regenerate the *_pb2* files with generate_proto.sh)."""
