"""A real two-host Ray cluster on one machine: two network namespaces joined by a veth pair
(the multihost tests and ``weightsync bench --transports ray-delta`` build it).

Host A (10.213.0.1) runs the Ray head, host B (10.213.0.2) a worker node; the test process
joins A's namespace (``setns`` on its main thread, so every thread Ray starts lives there)
and connects as the driver. Traffic stays between the two namespaces this module made;
teardown kills every process in them, deletes the veth pair and both namespaces, also when
a test failed. Needs root (``CAP_NET_ADMIN``); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ADDRESS_A = "10.213.0.1"
ADDRESS_B = "10.213.0.2"
PREFIX = 24
GCS_PORT = 6380
CLONE_NEWNET = 0x40000000
VENV_BIN = Path(sys.executable).parent
#: tries of each node's ``ray start``: beside a busy machine a node can miss Ray's own
#: start-up deadline ("The current node timed out during startup", once in a CI-like run);
#: the processes the failed try left in that namespace are killed before the next
RAY_START_TRIES = 2

logger = logging.getLogger(__name__)

# Slow the GCS's verdict on a silent node, so that a link cut of a few seconds (the tests
# cut it for less than 20 s) does not make Ray declare host B dead.
HEAD_ENV = {"RAY_health_check_failure_threshold": "20", "RAY_health_check_period_ms": "2000",
            "RAY_health_check_timeout_ms": "4000", "RAY_USAGE_STATS_ENABLED": "0"}


def run_command(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=check)


def setns(path: str | int) -> None:
    """Move the calling thread into the network namespace at ``path`` (or an open fd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY) if isinstance(path, str) else path
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")
    finally:
        if isinstance(path, str):
            os.close(fd)


class HomeNamespace:
    """The network namespace the calling thread came from: :meth:`enter` moves it (and the
    threads it starts from then on) into a named one, :meth:`leave` brings it back."""

    def __init__(self) -> None:
        self._fd = -1

    def enter(self, ns: str) -> None:
        if self._fd < 0:
            self._fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        setns(f"/run/netns/{ns}")

    def leave(self) -> None:
        if self._fd >= 0:
            setns(self._fd)
            os.close(self._fd)
            self._fd = -1


def unavailable_reason() -> str | None:
    """Why a two-host cluster cannot be built here (None if it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    if not (VENV_BIN / "ray").exists():
        return "needs the `ray` command next to the Python running the tests"
    probe = f"wsprobe{os.getpid()}"
    try:
        run_command("ip", "netns", "add", probe, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"`ip netns add` failed: {str(detail).strip()}"
    run_command("ip", "netns", "del", probe, timeout=10, check=False)
    return None


@dataclass
class TwoHostCluster:
    """Names and handles of the cluster; ``start()``/``stop()`` build and remove it."""

    tests_dir: str
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    temp_dir: str = ""
    node_a: str = ""  # Ray node ids
    node_b: str = ""
    _home: HomeNamespace = field(default_factory=HomeNamespace, repr=False)
    _saved_env: dict[str, str | None] = field(default_factory=dict)

    @property
    def ns_a(self) -> str:
        return f"wsmh{self.tag}a"

    @property
    def ns_b(self) -> str:
        return f"wsmh{self.tag}b"

    @property
    def veth_a(self) -> str:
        return f"wsv{self.tag}a"

    @property
    def veth_b(self) -> str:
        return f"wsv{self.tag}b"

    @property
    def address(self) -> str:
        return f"{ADDRESS_A}:{GCS_PORT}"

    # ------------------------------------------------------------------ network
    def network_up(self) -> None:
        """The two namespaces and the veth pair between them (no Ray)."""
        self._network_up()

    def network_down(self) -> None:
        """Kill every process in either namespace, delete the veth pair and namespaces."""
        self._kill(self.pids())
        run_command("ip", "-n", self.ns_a, "link", "del", self.veth_a, check=False)
        run_command("ip", "link", "del", self.veth_a, check=False)
        for ns in (self.ns_a, self.ns_b):
            run_command("ip", "netns", "del", ns, check=False)

    def enter(self, host: str = "a") -> None:
        """Move this process's calling thread (and the threads it starts from now on) onto
        host ``"a"`` or ``"b"``; ``leave`` comes back."""
        self._home.enter(self.ns_a if host == "a" else self.ns_b)

    def leave(self) -> None:
        self._home.leave()

    def _network_up(self) -> None:
        a, b = self.ns_a, self.ns_b
        run_command("ip", "netns", "add", a)
        run_command("ip", "netns", "add", b)
        run_command("ip", "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        run_command("ip", "link", "set", self.veth_a, "netns", a)
        run_command("ip", "link", "set", self.veth_b, "netns", b)
        run_command("ip", "-n", a, "addr", "add", f"{ADDRESS_A}/{PREFIX}", "dev", self.veth_a)
        run_command("ip", "-n", b, "addr", "add", f"{ADDRESS_B}/{PREFIX}", "dev", self.veth_b)
        for ns, dev in ((a, self.veth_a), (b, self.veth_b)):
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            run_command("ip", "-n", ns, "link", "set", dev, "up")

    def shape_link(self, rate: str) -> None:
        """Cap both directions of the veth pair at ``rate`` (tc syntax: ``10gbit``,
        ``1gbit``) with a token bucket on each end's egress, so that the bench sees a
        datacenter link instead of the memory-speed veth. ``unshape_link`` removes it."""
        burst = link_burst_bytes(rate)
        for ns, dev in ((self.ns_a, self.veth_a), (self.ns_b, self.veth_b)):
            run_command("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        rate, "burst", str(burst), "latency", "100ms")

    def unshape_link(self) -> None:
        """Remove what ``shape_link`` added (nothing if it was never shaped)."""
        for ns, dev in ((self.ns_a, self.veth_a), (self.ns_b, self.veth_b)):
            run_command("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def cut_link(self) -> None:
        """Take the link between the hosts down (both ends lose carrier)."""
        run_command("ip", "-n", self.ns_a, "link", "set", self.veth_a, "down")

    def restore_link(self) -> None:
        run_command("ip", "-n", self.ns_a, "link", "set", self.veth_a, "up")
        run_command("ip", "-n", self.ns_b, "link", "set", self.veth_b, "up")

    # ------------------------------------------------------------------ ray
    def _python_path(self) -> str:
        """``tests_dir`` (the tests' directory, or any directory actors import from), then
        the caller's PYTHONPATH: actors must import the weightsync under test."""
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return os.pathsep.join([self.tests_dir, *inherited])

    def _ray_start(self, ns: str, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = ["ip", "netns", "exec", ns, str(VENV_BIN / "ray"), "start", "--num-cpus=1",
               "--object-store-memory=80000000", "--disable-usage-stats", *args]
        run_env = os.environ | {"PYTHONPATH": self._python_path(), "RAY_USAGE_STATS_ENABLED": "0",
                                "RAY_AUTH_MODE": "token", **self._token_env()}
        for attempt in range(1, RAY_START_TRIES + 1):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                  env=run_env | (env or {}))
            if proc.returncode == 0:
                return
            logger.warning("`ray start` in %s failed (try %d of %d): %s", ns, attempt,
                           RAY_START_TRIES, proc.stderr[-500:])
            self._kill(self._pids_in(ns))  # what the failed start left on that host only
        raise RuntimeError(f"`ray start` in {ns} failed ({proc.returncode}) {RAY_START_TRIES} "
                           f"times:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")

    def _token_env(self) -> dict[str, str]:
        """Where the cluster's own Ray token is (unless the caller set ``RAY_AUTH_TOKEN``,
        which every node then inherits): a fresh machine has no ``~/.ray/auth_token``."""
        if os.environ.get("RAY_AUTH_TOKEN"):
            return {}
        return {"RAY_AUTH_TOKEN_PATH": os.path.join(self.temp_dir, "auth_token")}

    def start(self) -> None:
        import ray

        self.temp_dir = tempfile.mkdtemp(prefix="wsmh")
        token_path = os.path.join(self.temp_dir, "auth_token")
        with open(os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self._network_up()
        self._ray_start(self.ns_a, "--head", f"--node-ip-address={ADDRESS_A}",
                        f"--port={GCS_PORT}", "--include-dashboard=false",
                        f"--temp-dir={self.temp_dir}", env=HEAD_ENV)
        self._ray_start(self.ns_b, f"--address={self.address}", f"--node-ip-address={ADDRESS_B}")
        self._saved_env = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
        os.environ.update({"RAY_AUTH_MODE": "token", **self._token_env()})  # as the nodes run
        _refresh_ray_config()
        self._home.enter(self.ns_a)  # the driver lives on host A
        ray.init(address=self.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": self._python_path()}})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if ADDRESS_A in nodes and ADDRESS_B in nodes:
                self.node_a, self.node_b = nodes[ADDRESS_A], nodes[ADDRESS_B]
                return
            time.sleep(0.2)
        raise RuntimeError(f"host B never joined the cluster: {ray.nodes()}")

    def on(self, node: str) -> dict[str, object]:
        """Actor options that place it on ``node`` ("a", "b" or a node id)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = {"a": self.node_a, "b": self.node_b}.get(node, node)
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

    def pids(self) -> list[int]:
        """Processes in either namespace, this one excepted."""
        return sorted(set(self._pids_in(self.ns_a)) | set(self._pids_in(self.ns_b)))

    @staticmethod
    def _pids_in(ns: str) -> list[int]:
        """Processes in namespace ``ns``, this one excepted."""
        out = run_command("ip", "netns", "pids", ns, check=False, timeout=10).stdout
        return sorted(int(p) for p in out.split() if int(p) != os.getpid())

    def stop(self) -> None:
        """Remove everything ``start`` made, whatever state it is in."""
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _refresh_ray_config()
        self.leave()
        self.network_down()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _kill(pids: list[int]) -> None:
        """SIGTERM, then SIGKILL after 2 s: Ray's GCS server, monitor and runtime-env agents
        outlive a SIGTERM by more than 10 s, and a torn-down test cluster keeps nothing."""
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(_alive(p) for p in pids):
                time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """What is still there after ``stop``: namespaces, links, live processes."""
        out = []
        listed = run_command("ip", "netns", "list", check=False).stdout
        out += [f"netns {ns}" for ns in (self.ns_a, self.ns_b) if ns in listed]
        links = run_command("ip", "-o", "link", check=False).stdout
        out += [f"link {dev}" for dev in (self.veth_a, self.veth_b) if dev in links]
        mine = run_command("pgrep", "-f", self.temp_dir or "/nonexistent", check=False).stdout.split()
        out += [f"process {p}" for p in mine if _alive(int(p))]
        return out


#: tc's rate units, in bits per second
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_link_rate(rate: str) -> int:
    """Bits per second of a tc rate such as ``10gbit`` or ``500mbit``; ValueError if the
    text is not one (checked before any cluster is built)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"{rate!r} is not a link rate such as 10gbit, 1gbit or 500mbit")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits <= 0:
        raise ValueError(f"link rate {rate!r} must be positive")
    return int(bits)


def link_burst_bytes(rate: str) -> int:
    """The token bucket's size for ``rate``: 10 ms of traffic (at least 64 KiB), enough for
    the kernel's timer resolution and the veth's 64 KiB GSO packets at any rate."""
    return max(parse_link_rate(rate) // 8 // 100, 64 * 1024)


def _refresh_ray_config() -> None:
    """Make this process's Ray read ``RAY_AUTH_MODE`` and the token again (it caches both:
    each cluster has its own token)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@contextlib.contextmanager
def two_host_network() -> Iterator[TwoHostCluster]:
    """Two hosts joined by a link, without Ray: the caller runs what it needs on each
    (``ip netns exec``, or :meth:`TwoHostCluster.enter`). Everything is removed on exit."""
    cluster = TwoHostCluster("")
    try:
        cluster.network_up()
        yield cluster
    finally:
        cluster.leave()
        cluster.network_down()


@contextlib.contextmanager
def two_host_cluster(tests_dir: str) -> Iterator[TwoHostCluster]:
    cluster = TwoHostCluster(tests_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
