"""`jaxserve.client`: the Python client of `jaxserve serve` (see jaxserve/serve/client.py)."""
from jaxserve.serve.client import Client, sampling_options
from jaxserve.serve.jaxserve_pb2 import GenerateResponse, ModelInfoResponse, ServerStatsResponse

__all__ = ["Client", "sampling_options", "GenerateResponse", "ModelInfoResponse", "ServerStatsResponse"]
