"""The generated protobuf and gRPC modules of Triton's ``grpc_service.proto`` (KServe V2 plus Triton's
statistics, repository, shared-memory, trace and logging messages), as ``tritonclient.grpc`` ships them.

Why these and not our own ``protoc`` output: they are byte for byte what ``tritonclient.grpc`` sends and
parses, so wire compatibility with the client users default to holds by construction (the plain KServe
proto lacks the Triton extensions' messages), there is no generated code in the repository and no build step,
and the protobuf runtime they need is pinned by the same package. The cost: the server depends on a client
package (``tritonclient[grpc]``), whose import also loads its client code (a few milliseconds, once).
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as config_pb
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

__all__ = ["config_pb", "pb", "pb_grpc"]
