"""Hosts of our own: N Linux network namespaces on this machine, one Ray node each
(docs/operations.md: Networking, "Checking it on one machine"; docs/benchmarks.md: Hosts with
cores of their own).

Host ``i`` has its own loopback and ``eth0`` at ``10.77.0.<i+1>/24`` on a bridge in a namespace
of its own (the root namespace's network is never touched); host 0 runs the Ray head, and
drivers run there (:meth:`NetnsHosts.run`). ``pin=True`` gives each host ``cpus_per_host`` cores
of its own (:func:`host_cpus`; a cpuset, else ``taskset``: ``pinning`` says which);
:meth:`NetnsHosts.shape` limits the links. Teardown signals only the processes inside the
namespaces, never ``ray stop``. Needs root and iproute2 (:func:`unavailable` says why not).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsray.errors import NetnsUnavailable

SUBNET = "10.77.0"
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
_JOIN_CPUSET = 'echo $$ > "$0/cgroup.procs" && exec "$@"'  # sh -c: join the cgroup $0, then run argv
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


def host_cpus(n: int, per_host: int, available: list[int] | None = None) -> list[list[int]]:
    """The cores of each of ``n`` hosts, ``per_host`` each: host ``i`` takes cores
    ``[i * per_host, (i + 1) * per_host)`` of ``available`` (default: this process's allowed
    cores, sorted), wrapping round when there are fewer (hosts then share cores)."""
    if per_host < 1:
        raise ValueError(f"cpus per host must be >= 1, got {per_host}")
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if not cores:
        raise ValueError("no cores available")
    return [[cores[(i * per_host + k) % len(cores)] for k in range(per_host)] for i in range(n)]


def _cpuset_writable() -> bool:
    """Whether a cgroup v1 cpuset can be made here (the controller mounted, root)."""
    return (CPUSET_ROOT / "cpuset.cpus").exists() and os.access(CPUSET_ROOT, os.W_OK)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


class NetnsHosts:
    """``n`` namespace hosts with a Ray cluster over them; a context manager.

    ``dashboard`` starts the head's dashboard on ``0.0.0.0:8265`` (for ``ray job submit``);
    Ray runs with token authentication (``RAY_AUTH_MODE=token``) on every host. ``pin``: each
    host on ``cpus_per_host`` cores of its own (:func:`host_cpus`, wrapping round when the
    hosts ask for more cores than there are: ``shared_cores``), joined by every command started
    in the host before it runs; ``start_ray=False`` makes the hosts (network, cores) without a
    Ray cluster.
    """

    def __init__(
        self,
        n: int,
        cpus_per_host: int = 1,
        object_store_bytes: int = 150 * 1024**2,
        dashboard: bool = False,
        tag: str | None = None,
        pin: bool = False,
        start_ray: bool = True,
    ) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"between 1 and 200 hosts, got {n}")
        self.cpus: list[list[int]] | None = host_cpus(n, cpus_per_host) if pin else None
        cores = {c for cs in self.cpus or [] for c in cs}
        self.shared_cores = bool(self.cpus) and len(cores) < n * cpus_per_host
        self.pinning: str | None = None  # "cpuset" or "taskset" once made
        self.start_ray = start_ray
        self._cpusets: list[Path] = []
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
        """``argv`` as run inside host ``host``'s namespace (and on its cores when pinned)."""
        inside = ["ip", "netns", "exec", self.hosts[host].netns]
        if self.pinning == "cpuset":  # joined before `ip netns exec`, which mounts a sysfs of its own
            return ["sh", "-c", _JOIN_CPUSET, str(self._cpusets[host]), *inside, *argv]
        if self.pinning == "taskset" and self.cpus is not None:
            return [*inside, "taskset", "-c", ",".join(map(str, self.cpus[host])), *argv]
        return [*inside, *argv]

    def busy(self, host: int, loops: int = 1) -> list[subprocess.Popen]:
        """Start ``loops`` busy loops inside host ``host`` (on its cores when pinned); they end
        with the hosts (or when killed)."""
        code = "while True:\n    pass"
        return [self.popen(host, [sys.executable, "-c", code], f"busy-h{host}-{k}.log") for k in range(loops)]

    def run(
        self, host: int, argv: list[str], timeout: float = 600, env: dict | None = None, **kwargs: Any
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
            self._make_cpusets()
            if self.start_ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
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

    def _make_cpusets(self) -> None:
        """One cpuset per host (or ``taskset``); nothing unless pinned."""
        if self.cpus is None:
            return
        if not _cpuset_writable():
            if shutil.which("taskset") is None:
                raise NetnsUnavailable("pinning hosts to cores needs the cgroup v1 cpuset controller or taskset")
            self.pinning = "taskset"
            return
        mems = (CPUSET_ROOT / "cpuset.mems").read_text().strip()
        for h, cpus in zip(self.hosts, self.cpus, strict=True):
            d = CPUSET_ROOT / f"{self.tag}-h{h.index}"
            d.mkdir(exist_ok=True)
            self._cpusets.append(d)
            (d / "cpuset.cpus").write_text(",".join(map(str, cpus)))
            (d / "cpuset.mems").write_text(mems)
        self.pinning = "cpuset"

    def _ray_start(self, h: Host) -> list[str]:
        from hpsray.cluster.runtime import FAST_CONNECT

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
        argv += ["--head", f"--port={RAY_PORT}", f"--system-config={json.dumps(FAST_CONNECT)}"]
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
                elif rate_bit is not None:
                    qdisc = ["tbf", "rate", rate_bit, "burst", "256kb", "latency", "50ms"]
                else:
                    continue  # a delay of 0 and no rate: nothing to shape
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
        for d in self._cpusets:  # empty once the processes are gone
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self._cpusets.clear()
        self._made.clear()
        self._procs.clear()
        shutil.rmtree(self.temp, ignore_errors=True)
