"""Which network address this node's connections use: the one Ray assigned to the node, never
the hostname's (docs/operations.md: Networking; issue 20).

:func:`bind_collectives` sets the backend's ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` in
this process, before the group is made (torch reads the first whenever it makes a gloo group,
NCCL the second when it makes a communicator), to the interface chosen, strongest first: the
variable when already set, the interface in ``HPSRAY_NETWORK`` (a CIDR block), the interface
holding the node's Ray address.
"""

from __future__ import annotations

import ipaddress
import os
import warnings
from dataclasses import dataclass

import ray

SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
NETWORK_ENV = "HPSRAY_NETWORK"


@dataclass(frozen=True)
class Binding:
    """What a collective backend was told to bind to: ``variable=interface``, and why."""

    variable: str
    interface: str
    address: str | None  # the address that chose the interface (None when the user named it)
    source: str  # "user" (variable already set), "network" (HPSRAY_NETWORK), "node" (Ray's node address)
    #              or "default" (no interface holds the node's address: the backend chooses, as before)


def node_address() -> str:
    """The address Ray assigned to the node this process runs on."""
    return ray.util.get_node_ip_address()


def interface_addresses() -> dict[str, list[str]]:
    """Every network interface of this host (of its network namespace) and its IP addresses."""
    import socket

    import psutil  # Ray bundles it (ray/thirdparty_files, on the path once ray is imported: above)

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def interface_holding(address: str) -> str:
    """The name of the interface that holds ``address``; LookupError naming those seen if none."""
    wanted = ipaddress.ip_address(address)
    seen = interface_addresses()
    for name, addrs in seen.items():
        if any(ipaddress.ip_address(a) == wanted for a in addrs):
            return name
    raise LookupError(
        f"no network interface of this host holds {address} (the node's address); "
        f"interfaces: {_describe(seen)}; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME "
        f"or {NETWORK_ENV} (docs/operations.md#networking)"
    )


def interface_in(network: str) -> tuple[str, str]:
    """``(interface, address)`` of the first non-loopback interface with an address in ``network``."""
    try:
        block = ipaddress.ip_network(network, strict=False)
    except ValueError as exc:
        raise ValueError(f"{NETWORK_ENV}={network!r} is not a CIDR block such as 10.0.0.0/16") from exc
    seen = interface_addresses()
    for name, addrs in sorted(seen.items()):
        for a in addrs:
            ip = ipaddress.ip_address(a)
            if ip.version == block.version and ip in block and not ip.is_loopback:
                return name, a
    raise LookupError(
        f"{NETWORK_ENV}={network}: no interface of this host has an address in it; interfaces: {_describe(seen)}"
    )


def bind_collectives(backend: str) -> Binding:
    """Point ``backend``'s transport (``"gloo"`` or ``"nccl"``) at this node's interface.

    Call in the process that then creates the group, before creating it. Sets the backend's
    ``*_SOCKET_IFNAME`` variable in this process unless it is already set (the user's choice
    is kept). When no interface holds the node's address (a NAT-ed address given to
    ``--node-ip-address``) the variable stays unset, with a warning: the backend chooses as it
    would without hpsray. Raises LookupError when ``HPSRAY_NETWORK`` matches no interface.
    """
    if backend not in SOCKET_IFNAME:
        raise ValueError(f"unknown collective backend {backend!r}; expected one of {sorted(SOCKET_IFNAME)}")
    variable = SOCKET_IFNAME[backend]
    if os.environ.get(variable):
        return Binding(variable, os.environ[variable], None, "user")
    if os.environ.get(NETWORK_ENV):
        interface, address = interface_in(os.environ[NETWORK_ENV])
        source = "network"
    else:
        address = node_address()
        try:
            interface, source = interface_holding(address), "node"
        except LookupError as exc:
            warnings.warn(f"{exc}; {backend} picks its own address", RuntimeWarning, stacklevel=2)
            return Binding(variable, "", address, "default")
    os.environ[variable] = interface
    return Binding(variable, interface, address, source)


def _describe(seen: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} {'/'.join(addrs) or '(none)'}" for name, addrs in sorted(seen.items())) or "(none)"
