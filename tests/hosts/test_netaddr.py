"""Address selection for collective groups (hpsray/cluster/netaddr.py): overrides and errors.

These run on any Linux machine; the choice from Ray's node address is exercised across namespace
hosts in test_hosts.py.
"""

import sys

import pytest

from hpsray.cluster import netaddr


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", netaddr.NETWORK_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_users_variable_is_kept(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "ib0")
    clean_env.setenv(netaddr.NETWORK_ENV, "198.51.100.0/24")  # weaker than the variable: never consulted
    assert netaddr.bind_collectives("gloo") == netaddr.Binding("GLOO_SOCKET_IFNAME", "ib0", None, "user")


@pytest.mark.skipif(sys.platform != "linux", reason="interface names are Linux's")
def test_the_interface_holding_an_address():
    assert netaddr.interface_holding("127.0.0.1") == "lo"
    with pytest.raises(LookupError, match=r"no network interface of this host holds 198\.51\.100\.7.*lo 127\.0\.0\.1"):
        netaddr.interface_holding("198.51.100.7")


def test_a_network_no_interface_is_in_is_an_error_naming_the_interfaces(clean_env):
    clean_env.setenv(netaddr.NETWORK_ENV, "198.51.100.0/24")
    with pytest.raises(LookupError, match=r"HPSRAY_NETWORK=198\.51\.100\.0/24: no interface .* interfaces: "):
        netaddr.bind_collectives("nccl")
    assert "NCCL_SOCKET_IFNAME" not in __import__("os").environ
    clean_env.setenv(netaddr.NETWORK_ENV, "10.77.0.300/24")
    with pytest.raises(ValueError, match="not a CIDR block"):
        netaddr.bind_collectives("gloo")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown collective backend 'mpi'"):
        netaddr.bind_collectives("mpi")
