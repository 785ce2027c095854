"""Network faults on namespace hosts (:mod:`hpsray.cluster.netns`), for chaos tests (issue 34).

A host's link cut and restored (its port on the switch down/up: the host sees no carrier, its
peers' packets are dropped), packet loss and delay on it (``tc netem`` on both ends of its
link), a partition between two hosts only (blackhole routes both ways, every other pair still
talking), and the stacks of the Python processes inside the hosts (``py-spy dump``) so that a
hang is diagnosable from a test's failure message. :class:`ChaosHosts` is a
:class:`~hpsray.cluster.netns.NetnsHosts` whose hosts other than the head offer the
``hpsray_node`` resource (the head runs the driver and the GCS, as a head without disks does),
with Ray's node health checks tuned by the caller, and can bring a lost host's Ray node back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from hpsray.cluster.netns import Host, NetnsHosts

__all__ = ["ChaosHosts", "heal", "link_down", "link_up", "netem", "partition", "stacks"]


def _run(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")


def link_down(hosts: NetnsHosts, host: int) -> None:
    """Cut host ``host``'s link (its switch port down)."""
    _run(["ip", "-n", hosts.switch, "link", "set", f"p{host}", "down"])


def link_up(hosts: NetnsHosts, host: int) -> None:
    """Restore host ``host``'s link."""
    _run(["ip", "-n", hosts.switch, "link", "set", f"p{host}", "up"])


def _loss_bytecode(loss_pct: float) -> str:
    """Classic BPF for ``cls_bpf`` in direct-action mode: drop (TC_ACT_SHOT) a packet when a
    random 32-bit number falls below ``loss_pct`` % of its range, else pass (TC_ACT_OK)."""
    threshold = min(int(loss_pct / 100 * 2**32), 2**32 - 1)
    random_word = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: "ld rand"
    return f"4,32 0 0 {random_word},53 0 1 {threshold},6 0 0 0,6 0 0 2"


def netem(hosts: NetnsHosts, host: int, loss_pct: float = 0.0, delay_ms: float = 0.0) -> str:
    """Lose ``loss_pct`` % of the packets and delay each by ``delay_ms`` on both directions of
    host ``host``'s link (``tc netem``); ``0, 0`` removes it. A kernel without ``sch_netem``
    gets the loss alone, from a random-drop BPF filter on each end's ingress (no delay: nothing
    else here can delay). Returns what was applied."""
    h = hosts.hosts[host]
    ends = ((h.netns, "eth0"), (hosts.switch, f"p{host}"))
    for ns, dev in ends:
        for kind in ("root", "clsact"):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, kind], capture_output=True)
    if not (loss_pct or delay_ms):
        return "none"
    qdisc = ["netem", "loss", f"{loss_pct}%", "delay", f"{delay_ms}ms"]
    tried = subprocess.run(
        ["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", "eth0", "root", *qdisc],
        capture_output=True,
        text=True,
    )
    if tried.returncode == 0:
        _run(["ip", "netns", "exec", hosts.switch, "tc", "qdisc", "add", "dev", f"p{host}", "root", *qdisc])
        return f"netem loss {loss_pct}% delay {delay_ms} ms"
    if not loss_pct:
        raise RuntimeError(f"no delay without sch_netem: {tried.stderr.strip()}")
    for ns, dev in ends:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "clsact"])
        bpf = ["bpf", "da", "bytecode", _loss_bytecode(loss_pct)]
        _run(["ip", "netns", "exec", ns, "tc", "filter", "add", "dev", dev, "ingress", *bpf])
    return f"BPF random drop {loss_pct}% (no sch_netem in this kernel: no delay)"


def partition(hosts: NetnsHosts, a: int, b: int) -> None:
    """Hosts ``a`` and ``b`` stop reaching each other (each still reaches every other host)."""
    _run(["ip", "-n", hosts.hosts[a].netns, "route", "add", "blackhole", f"{hosts.hosts[b].address}/32"])
    _run(["ip", "-n", hosts.hosts[b].netns, "route", "add", "blackhole", f"{hosts.hosts[a].address}/32"])


def heal(hosts: NetnsHosts, a: int, b: int) -> None:
    """Undo :func:`partition` (idempotent)."""
    for x, y in ((a, b), (b, a)):
        argv = ["ip", "-n", hosts.hosts[x].netns, "route", "del", "blackhole", f"{hosts.hosts[y].address}/32"]
        subprocess.run(argv, capture_output=True)


def _python_pids(hosts: NetnsHosts, extra: list[int]) -> list[tuple[int, str]]:
    found = []
    for pid in [*extra, *(p for h in range(hosts.n) for p in hosts.pids(h))]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if ("python" in cmd or cmd.startswith("ray::")) and (pid, cmd) not in found:
            found.append((pid, cmd))
    return found


def stacks(hosts: NetnsHosts, extra: Sequence[int] = (), limit: int = 60_000) -> str:
    """``py-spy dump`` of every Python process inside the hosts (and of ``extra`` pids): the
    driver, the Ray workers (trainers, MEM-PS, ...); what it cannot dump, it says."""
    spy = shutil.which("py-spy") or str(os.path.join(os.path.dirname(sys.executable), "py-spy"))
    parts = []
    for pid, cmd in _python_pids(hosts, list(extra)):
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
            text = out.stdout if out.returncode == 0 else f"(py-spy failed: {out.stderr.strip()[-300:]})"
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"(py-spy: {e})"
        parts.append(f"=== pid {pid}: {cmd[:150]}\n{text}")
    return "\n".join(parts)[-limit:]


class ChaosHosts(NetnsHosts):
    """Namespace hosts whose hosts 1.. offer ``hpsray_node`` (the head trains nothing), with
    extra environment for every Ray process (``ray_env``: e.g. Ray's health-check settings)."""

    def __init__(self, n: int, ray_env: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(n, **kwargs)
        self.ray_env = dict(ray_env or {})

    def env(self, **extra: str) -> dict[str, str]:
        return super().env(**{**self.ray_env, **extra})

    def _ray_start(self, h: Host) -> list[str]:
        argv = super()._ray_start(h)
        return argv if h.index == 0 else [*argv, f"--resources={json.dumps({'hpsray_node': 1})}"]

    def revive(self, host: int, timeout: float = 180) -> None:
        """Bring host ``host``'s Ray node back after a fault: its link up and unshaped, its
        partitions healed, its processes ended (by PID) and ``ray start`` run again, until every
        host's node is alive."""
        link_up(self, host)
        netem(self, host)
        for other in range(self.n):
            if other != host:
                heal(self, host, other)
        for sig in (15, 9):
            self.kill_host(host, sig)
            deadline = time.time() + 10
            while self.pids(host) and time.time() < deadline:
                time.sleep(0.2)
        proc = self.popen(host, self._ray_start(self.hosts[host]), f"ray-h{host}-revived-{time.time():.0f}.log")
        self._wait(self.n, None, {host: proc}, timeout, 2)
