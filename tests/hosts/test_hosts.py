"""Multi-node training across hosts with their own addresses (issue 20), on namespace hosts.

Every host is a network namespace with its own loopback and address (conftest.py); the
hostname resolves as on this machine, not to the host's address. Nothing sets an interface
variable: hpsray must bind its collective groups to the address Ray gave each node. The scale
bench's exchange probe is measured here too, on the same hosts (a module of its own would make
them again: ~20 s).
"""

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import in_host

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
LISTEN = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 47123)); s.listen(); print("listening", flush=True); time.sleep(30)
"""
DIAL = """
import json, socket
out = {}
for address in ("10.77.0.2", "127.0.0.1"):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((address, 47123)); out[address] = "connected"
    except OSError as exc:
        out[address] = type(exc).__name__
print(json.dumps(out))
"""


def test_hosts_are_separate(hosts):
    """Host 1 listens on every address it has: host 0 reaches it at 10.77.0.2, not at its own loopback."""
    listener = hosts.popen(1, [sys.executable, "-c", LISTEN], "listen.log")
    try:
        deadline = time.time() + 30
        while "listening" not in (hosts.temp / "listen.log").read_text():
            assert listener.poll() is None and time.time() < deadline, (hosts.temp / "listen.log").read_text()
            time.sleep(0.2)
        dialled = json.loads(in_host(hosts, 0, DIAL).stdout)
    finally:
        listener.kill()
    assert dialled == {"10.77.0.2": "connected", "127.0.0.1": "ConnectionRefusedError"}
    # each host holds its own address and no other host's
    for h in hosts.hosts:
        out = hosts.run(h.index, ["ip", "-o", "addr", "show"], timeout=30)
        held = {field.split("/")[0] for line in out.stdout.splitlines() for field in line.split()[3:4]}
        assert h.address in held and not {o.address for o in hosts.hosts if o is not h} & held, out.stdout


def test_hpsray_network_picks_the_interface_in_the_block(hosts):
    """The override for multi-homed hosts: a CIDR block, the same on every host."""
    code = (
        "import json, os; os.environ['HPSRAY_NETWORK'] = '10.77.0.0/16'; "
        "from hpsray.cluster.netaddr import bind_collectives; b = bind_collectives('gloo'); "
        "print(json.dumps([b.interface, b.address, b.source, os.environ['GLOO_SOCKET_IFNAME']]))"
    )
    out = in_host(hosts, 1, code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == ["eth0", "10.77.0.2", "network", "eth0"]


def test_gloo_group_across_hosts_fails_unbound_and_forms_bound(drive):
    """Issue 20's failure, reproduced (gloo dials the peer's loopback), and bind_collectives' fix."""
    found = drive("gloo_group")
    assert found["unbound"]["ips"] == found["bound"]["ips"] and len(set(found["bound"]["ips"])) == 2
    assert not found["unbound"]["ok"] and "127.0.0.1" in found["unbound"]["error"], found["unbound"]
    assert found["bound"] == {**found["bound"], "ok": True, "sums": [3.0, 3.0]}


def _check_placement(placement, n):
    assert len({p["ip"] for p in placement}) == n  # one trainer per host
    for p in placement:  # bound to the host's interface, chosen from Ray's node address
        assert p == {**p, "interface": "eth0", "source": "node", "variable": "GLOO_SOCKET_IFNAME"}


@pytest.mark.parametrize("n", [2, 3])
def test_bsp_across_hosts_equals_reference_through_ssd(drive, n):
    found = drive("bsp", str(n))
    assert found["examples"] == (1700 if n == 2 else 1500)
    _check_placement(found["placement"], n)


def test_ssp_across_hosts_bounded_and_learns(drive):
    found = drive("ssp")
    _check_placement(found["placement"], 2)


def test_job_submitted_from_a_non_head_host_trains_on_every_host(hosts, tmp_path):
    """``ray job submit`` from host 2 to the head's dashboard: ``hpsray train`` on 3 hosts, then
    the reference replay of the same job matches its export."""
    from hpsray.data.generate import to_toml

    job = {
        "data.synthetic": {"rows": 3000, "eval_rows": 500, "slots": 4, "keys": 3000, "nnz": 4, "dense": 2, "seed": 1},
        "model": {"dim": 4, "hidden": [16]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
        "tiers": {"mem_rows": 1400, "ssd_path": str(tmp_path / "ssd")},
        "pipeline": {"batch_size": 500, "minibatch_size": 128},
        "cluster": {"nodes": 3},
    }
    path, report, export = tmp_path / "job.toml", tmp_path / "run.json", tmp_path / "export"
    path.write_text(to_toml(job))
    submit = [
        RAY,
        "job",
        "submit",
        "--address",
        hosts.dashboard_url,
        "--",
        sys.executable,
        "-m",
        "hpsray",
        "train",
        str(path),
        "--quiet",
        "--report",
        str(report),
        "--export",
        str(export),
    ]
    deadline = time.time() + 120
    while True:  # the head answers before its job agent takes submissions
        out = hosts.run(2, submit, timeout=400)
        if "No available agent" not in out.stdout + out.stderr or time.time() > deadline:
            break
        time.sleep(3)
    assert out.returncode == 0 and "succeeded" in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["nodes"] == 3 and result["examples"] == 3000, result
    assert len(result["per_node"]) == 3, result  # SSD spills are the BSP tests' part
    compare = hosts.run(
        2,
        [sys.executable, "-m", "hpsray", "train", str(path), "--quiet", "--reference", "--compare", str(export)],
        timeout=300,
    )
    assert compare.returncode == 0, compare.stdout[-2000:] + compare.stderr[-3000:]


def test_the_exchange_probe_measures_the_link_it_crosses(hosts, drive):
    """The scale bench's exchange probe measures the link it runs over (a rows transfer cannot
    beat the shaped rate) and its costs feed the scaling model."""
    rows = 2_000_000
    free = drive("exchange_probe", str(rows))
    hosts.shape("100mbit", None)
    try:
        shaped = drive("exchange_probe", str(rows))
    finally:
        hosts.shape(None, None)
    rate = 100e6 / 8
    # a batch's rows of one owner cross the link once: at 100 Mbit/s no faster than bytes / rate
    assert shaped["transfer_s"] >= 0.9 * rows / rate, shaped
    # a mini-batch's collectives move at least the dense all-reduce's half each way
    assert shaped["round_s"] >= 0.9 * (400_000 / 2) / rate, shaped
    assert free["transfer_s"] < shaped["transfer_s"] and free["round_s"] < shaped["round_s"], (free, shaped)
    assert free["round_cpu_s"] is None  # no cores of their own: no CPU figures
    assert shaped["count"] == 3 and shaped["rows_bytes"] == pytest.approx(rows)
