"""Serving: `jaxserve serve` (server.py) runs the engine loop (engine_loop.py: the threads that own the engines and
tokenize) under two APIs, gRPC (grpc_api.py; the service is jaxserve.proto, regenerate the *_pb2* files with
generate_proto.sh) and OpenAI-compatible HTTP (openai_http.py), with Prometheus metrics (metrics.py) and connection
hygiene and the API-key check (connections.py). The gRPC client is jaxserve/client.py."""
