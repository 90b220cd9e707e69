"""Who may register, list and unregister regions: a client on this host, unless the operator lets any client.

Shared memory works only for a client that shares the server's ``/dev/shm`` (or its GPU), i.e. one on its host;
any other client could only list every region with its key, unregister other clients' regions and fill the
server's budget of regions. So the extensions' register, unregister and status calls (REST and gRPC, system and
CUDA) are refused (403, gRPC PERMISSION_DENIED) to a peer that is not on a loopback address or a Unix socket,
unless ``SERVICE_SHARED_MEMORY_REMOTE`` is on. The protocol layers tell the peer as they learn it: its IP address
as text, or None for a Unix socket (which has none).
"""

from __future__ import annotations

import ipaddress

from service.errors import ForbiddenError, printable

SETTING = "SERVICE_SHARED_MEMORY_REMOTE"


def on_this_host(peer: str | None) -> bool:
    """Whether ``peer`` (an IP address, IPv6 possibly with a zone; None: a Unix socket) is a client on this host:
    a loopback address, IPv4-mapped ones included. Anything that is no address is not."""
    if peer is None:
        return True
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def check_caller(peer: str | None, remote: bool) -> None:
    """Refuse a shared-memory register, unregister or status call from ``peer`` unless it is on this host or
    ``remote`` (the operator's opt-in) is set."""
    if remote or on_this_host(peer):
        return
    raise ForbiddenError(f"shared-memory register, unregister and status calls are taken only from clients on this "
                         f"server's host (a loopback address or a Unix socket), not from {printable(peer)}: "
                         f"shared memory works only there; {SETTING}=true lets any client make them")
