"""A pool of hosts on one machine: a trainer and ``hosts`` worker hosts, each a network
namespace joined to one switch (a bridge in a namespace of its own) through its own veth.
The trainer's veth is its uplink, which :meth:`HostPool.shape_uplink` caps (tc), so that
what crosses the trainer's link, not this machine's memory bus, is what a test or a bench
measures. The tests of relaying and its bench build it; everything is removed on exit.
Needs root (``CAP_NET_ADMIN``)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

from weightsync.bench.multihost import HomeNamespace, link_burst_bytes, run_command

SUBNET = "10.214.0"
TRAINER_ADDRESS = f"{SUBNET}.1"


@dataclass
class HostPool:
    """Names of the pool's namespaces and links; ``up()``/``down()`` build and remove it."""

    hosts: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    _home: HomeNamespace = field(default_factory=HomeNamespace, repr=False)

    @property
    def switch(self) -> str:
        return f"wsp{self.tag}s"

    @property
    def trainer_ns(self) -> str:
        return f"wsp{self.tag}t"

    def host_ns(self, index: int) -> str:
        return f"wsp{self.tag}h{index}"

    def host_address(self, index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def _nodes(self) -> list[tuple[str, str, str]]:
        """(namespace, its veth's end in the switch, its address) of every node."""
        nodes = [(self.trainer_ns, f"wsp{self.tag}tu", TRAINER_ADDRESS)]
        nodes += [(self.host_ns(i), f"wsp{self.tag}h{i}u", self.host_address(i))
                  for i in range(self.hosts)]
        return nodes

    def up(self) -> None:
        run_command("ip", "netns", "add", self.switch)
        run_command("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", self.switch, "link", "set", "br0", "up")
        for ns, port, address in self._nodes():
            run_command("ip", "netns", "add", ns)
            run_command("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run_command("ip", "link", "set", port, "netns", self.switch)
            run_command("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            run_command("ip", "-n", self.switch, "link", "set", port, "up")
            run_command("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            run_command("ip", "-n", ns, "link", "set", "eth0", "up")

    def shape_uplink(self, rate: str) -> None:
        """Cap the trainer's link at ``rate`` (tc syntax: ``250mbit``, ``1gbit``), both ways."""
        ns, port, _ = self._nodes()[0]
        burst = str(link_burst_bytes(rate))
        for where, dev in ((ns, "eth0"), (self.switch, port)):
            run_command("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", burst, "latency", "100ms")

    def enter_trainer(self) -> None:
        """Move the calling thread (and the threads it starts from now on) onto the trainer."""
        self._home.enter(self.trainer_ns)

    def leave(self) -> None:
        self._home.leave()

    def pids(self, ns: str) -> list[int]:
        found = run_command("ip", "netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in found if p.isdigit() and int(p) != os.getpid()]

    def down(self) -> None:
        """Kill every process on the pool's hosts, then remove its namespaces and links."""
        for ns, _, _ in self._nodes()[1:]:
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns, _, _ in self._nodes():
            run_command("ip", "netns", "del", ns, check=False)
        run_command("ip", "netns", "del", self.switch, check=False)


@contextlib.contextmanager
def host_pool(hosts: int) -> Iterator[HostPool]:
    """A pool of ``hosts`` worker hosts and a trainer, removed on exit."""
    pool = HostPool(hosts)
    try:
        pool.up()
        yield pool
    finally:
        pool.leave()
        pool.down()
