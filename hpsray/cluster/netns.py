"""Hosts of our own: N Linux network namespaces on this machine, one Ray node each.

Each host is a network namespace with its own loopback and one interface ``eth0`` holding
``10.77.0.<i+1>/24``; the interfaces are veth pairs whose other ends sit on a bridge in a
further namespace (the switch), so the root namespace's network is never touched. A host
cannot reach another host's loopback, and its hostname resolves as the machine's does
(usually to a loopback address), as on real Debian/Ubuntu hosts: the conditions of issue 20.
Host 0 runs the Ray head (``ray start --head --node-ip-address 10.77.0.1 --block``), every
other host a Ray node joined to it; a driver runs inside a host through :meth:`NetnsHosts.run`.

What the hosts still share is this machine's processes and files: Ray finds a driver's local
raylet through the process table, where every host's raylet shows, and prefers the head's;
drivers therefore run on host 0, the head, where that choice is right (a driver elsewhere
would need ``ray.init(_node_ip_address=...)``). Workers are started by their own host's
raylet and are placed right.

Teardown signals the processes inside the namespaces (``ip netns pids``: only processes this
object started live there) and deletes the namespaces; it never runs ``ray stop``. Needs root
and iproute2 (:func:`unavailable` says why not). :meth:`NetnsHosts.shape` limits the links'
rate (``tc`` ``tbf``) and, where the kernel has ``sch_netem``, adds delay.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"
RAY_PORT = 6379
DASHBOARD_PORT = 8265
_WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.time() + float(sys.argv[3])
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]):
    if time.time() > deadline:
        sys.exit(f"only {sum(n['Alive'] for n in ray.nodes())} of {sys.argv[2]} Ray nodes joined")
    time.sleep(0.5)
"""


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (the message says why)."""


@dataclass(frozen=True)
class Host:
    """One namespace host: its namespace name and its address."""

    index: int
    netns: str
    address: str


def unavailable() -> str | None:
    """Why namespace hosts cannot be made on this machine, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"making network namespaces needs root (this process runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"hpsray-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


class NetnsHosts:
    """``n`` namespace hosts with a Ray cluster over them; a context manager.

    ``dashboard`` starts the head's dashboard on ``0.0.0.0:8265`` (for ``ray job submit``);
    Ray runs with token authentication (``RAY_AUTH_MODE=token``) on every host.
    """

    def __init__(
        self,
        n: int,
        cpus_per_host: int = 1,
        object_store_bytes: int = 150 * 1024**2,
        dashboard: bool = False,
        tag: str | None = None,
    ) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"between 1 and 200 hosts, got {n}")
        self.n, self.cpus_per_host, self.dashboard = n, cpus_per_host, dashboard
        self.object_store_bytes = object_store_bytes
        self.tag = tag or f"hps{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        self.temp = Path("/tmp") / f"hpsray-hosts-{self.tag}"
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    @property
    def address(self) -> str:
        """The Ray cluster's address (the head's GCS)."""
        return f"{self.hosts[0].address}:{RAY_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.hosts[0].address}:{DASHBOARD_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Ray commands and drivers on the hosts (token auth; no inherited Ray address)."""
        dropped = ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        return {**env, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra}

    def argv(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` as run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def run(
        self, host: int, argv: list[str], timeout: float = 600, env: dict | None = None, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host`` and wait for it (text output captured)."""
        return subprocess.run(
            self.argv(host, argv), env=env or self.env(), capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def popen(self, host: int, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` in the background, its output to ``log`` in the temp dir."""
        with open(self.temp / log, "w") as out:
            proc = subprocess.Popen(
                self.argv(host, argv),
                env=env or self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def __enter__(self) -> NetnsHosts:
        reason = unavailable()
        if reason:
            raise NetnsUnavailable(reason)
        self.temp.mkdir(parents=True, exist_ok=True)
        try:
            self._make_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_network(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            self._made.append(h.netns)
            port = f"p{h.index}"
            _ip("link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            # a default route, as a real host has: Ray finds the node's address from it
            _ip("-n", h.netns, "route", "add", "default", "dev", "eth0")

    def _ray_start(self, h: Host) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [
            ray,
            "start",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={h.address}",
            f"--num-cpus={self.cpus_per_host}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={self.temp / f'ray-h{h.index}'}",
        ]  # a host's own files, as on its own disk
        if h.index > 0:
            return [*argv, f"--address={self.address}"]
        argv += ["--head", f"--port={RAY_PORT}"]
        if self.dashboard:
            return [*argv, "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}"]
        return [*argv, "--include-dashboard=false"]

    def _start_ray(self, timeout: float = 240, restarts: int = 2) -> None:
        head = {0: self.popen(0, self._ray_start(self.hosts[0]), "ray-h0.log")}
        self._wait(1, None, head, timeout, restarts)
        nodes = {h.index: self.popen(h.index, self._ray_start(h), f"ray-h{h.index}.log") for h in self.hosts[1:]}
        self._wait(self.n, head[0], nodes, timeout, restarts)

    def _wait(
        self, n: int, head: subprocess.Popen | None, nodes: dict[int, subprocess.Popen], timeout: float, restarts: int
    ) -> None:
        """Wait until ``n`` Ray nodes are alive; a node whose ``ray start`` gave up (it times out
        when the machine is overloaded) is started again, ``restarts`` times at most; ``head``
        (once started) must stay up."""
        deadline = time.time() + timeout
        tries = dict.fromkeys(nodes, 0)
        argv = [sys.executable, "-c", _WAIT_FOR_NODES, self.address, str(n), "20"]
        while True:
            out = self.run(0, argv, timeout=120)
            if out.returncode == 0:
                return
            for i, proc in nodes.items():
                if proc.poll() is not None and tries[i] < restarts:
                    tries[i] += 1
                    nodes[i] = self.popen(i, self._ray_start(self.hosts[i]), f"ray-h{i}-retry{tries[i]}.log")
            gave_up = any(p.poll() is not None and tries[i] >= restarts for i, p in nodes.items())
            if (head is not None and head.poll() is not None) or gave_up or time.time() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.temp.glob("*.log")))
                raise RuntimeError(
                    f"the Ray cluster on the namespace hosts did not come up: {out.stderr[-1500:]}\n{logs}"
                )

    def pids(self, host: int) -> list[int]:
        """Processes running inside host ``host``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.hosts[host].netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> None:
        """Signal every process inside host ``host`` (a host lost)."""
        for pid in self.pids(host):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def shape(self, rate_bit: str | None = None, delay_ms: float | None = None) -> None:
        """Limit every host's link: ``rate_bit`` (``tc`` rate, e.g. ``"1gbit"``) on both directions
        of each link, ``delay_ms`` one-way per direction. ``None``/``None`` removes the shaping.

        Raises NetnsUnavailable when the kernel lacks the queueing discipline needed
        (delay needs ``sch_netem``).
        """
        for h in self.hosts:
            for ns, dev in ((h.netns, "eth0"), (self.switch, f"p{h.index}")):
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True
                )
                if rate_bit is None and delay_ms is None:
                    continue
                if delay_ms:
                    qdisc = ["netem", "delay", f"{delay_ms}ms"] + (["rate", rate_bit] if rate_bit else [])
                else:
                    qdisc = ["tbf", "rate", rate_bit, "burst", "256kb", "latency", "50ms"]
                out = subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc],
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    raise NetnsUnavailable(f"`tc qdisc add ... {' '.join(qdisc)}` failed: {out.stderr.strip()}")

    def close(self) -> None:
        """Stop everything inside the namespaces (by PID) and delete them; idempotent."""
        hosts = [h for h in self.hosts if h.netns in self._made]
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for h in hosts:
                self.kill_host(h.index, sig)
            deadline = time.time() + grace
            while time.time() < deadline and any(self.pids(h.index) for h in hosts):
                time.sleep(0.2)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._procs.clear()
        shutil.rmtree(self.temp, ignore_errors=True)
