"""gRPC serving: `jaxserve serve` (server.py), its Python client and `jaxserve client` (client.py), Prometheus
metrics (metrics.py) and the API (jaxserve.proto; regenerate the *_pb2* files with generate_proto.sh)."""
