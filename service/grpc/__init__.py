"""KServe V2 (Open Inference Protocol) over gRPC, with Triton's statistics and repository extensions.

The same ``DataPlane`` as REST behind ``inference.GRPCInferenceService``: ``server`` (lifecycle, options,
TLS), ``servicer`` (the RPCs, thin), ``codecs`` (messages <-> numpy and the dataplane's dicts), ``errors``
(``ServiceError`` -> gRPC status). ``messages`` names the generated protobuf modules this package speaks.
"""
