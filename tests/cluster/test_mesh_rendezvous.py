"""The device mesh's rendezvous store (hpsray/cluster/mesh.py: open_store; issue 45): bound to
the node's address only, and every rank checked against the job token before the group forms.
Ranks as threads of this process (the store only; the group itself: test_device_processes.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from hpsray.cluster.mesh import open_store, rendezvous_address
from hpsray.errors import AuthenticationError


def _listening_ips(port: int) -> set[str]:
    return {
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"
    }


def _rank0(address: str, world: int, timeout_s: float, out: dict) -> None:
    try:
        out["store"] = open_store(address, world, 0, timeout_s)
    except BaseException as e:  # noqa: BLE001 - checked by the test
        out["error"] = e


def test_the_store_listens_on_the_node_address_and_admits_ranks_with_the_token():
    address = rendezvous_address("127.0.0.1")
    port = int(address.split(":")[2].split("?")[0])
    out: dict = {}
    t = threading.Thread(target=_rank0, args=(address, 2, 20, out))
    t.start()
    store1 = open_store(address, 2, 1, 20)
    t.join(30)
    assert "error" not in out, out
    assert _listening_ips(port) == {"127.0.0.1"}  # torch's own store would listen on every address
    store1.set("x", b"1")
    assert out["store"].get("x") == b"1"


def test_a_rank_with_another_token_is_refused_and_rank_0_does_not_wait_forever():
    address = rendezvous_address("127.0.0.1")
    out: dict = {}
    t = threading.Thread(target=_rank0, args=(address, 2, 3, out))
    t.start()
    other = address.split("?")[0] + "?token=" + "ab" * 32
    with pytest.raises(AuthenticationError, match="does not hold this job's token"):
        open_store(other, 2, 1, 3)
    t.join(30)
    assert not t.is_alive() and "timeout" in str(out["error"]).lower()


def test_rank_0_refuses_a_forged_proof():
    address = rendezvous_address("127.0.0.1")
    host, port = "127.0.0.1", int(address.split(":")[2].split("?")[0])
    out: dict = {}
    t = threading.Thread(target=_rank0, args=(address, 2, 10, out))
    t.start()
    intruder = dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=10))
    intruder.set("hpsray/proof/rank/1", b"\0" * 32)  # connects (torch's store has no auth) but cannot prove
    t.join(30)
    assert isinstance(out.get("error"), AuthenticationError) and "rank 1" in str(out["error"])


def test_an_address_without_a_token_is_refused():
    with pytest.raises(ValueError, match="token"):
        open_store("tcp://127.0.0.1:29999", 2, 1, 1)
