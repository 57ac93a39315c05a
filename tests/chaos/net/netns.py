"""Network namespaces joined by a bridge, and partitions that are silence, not refusals.

    net = Network(["redis", "trainer", "engine-0"])    # root only; unavailable() says why not
    net.address("redis")                                # 10.77.0.10, only inside the namespaces
    net.argv("redis", ["redis-server", ...])            # ip netns exec ms1234-redis redis-server
    p = net.partition("engine-0", 30)                   # silent for 30 s, healed by a timer
    p = net.partition("trainer", 30, peers=["redis"])   # only trainer <-> redis
    net.call_in("probe", httpx.get, url)                # a call from inside a namespace
    net.close()                                         # what runs inside killed, all deleted

Layout: a namespace per role (`ms<pid>-<role>`, so two harnesses never meet and a dead one's
leftovers are recognised), each with `lo` up and one `eth0`, the end of a veth pair whose
other end is a port of the bridge `br0` inside the namespace `ms<pid>-net`. Nothing is made,
changed or read in the root namespace: the veth pairs are created inside `ms<pid>-net` with
their peer end put straight into the role's namespace. The addresses (10.77.0.0/24) exist only
behind that bridge, so a fixed subnet cannot clash with the host's or another harness's.

Why a partition rewrites ARP entries. Across hosts, a partition is silence: a connect or a send
waits for its own timeout, with no RST, no ECONNREFUSED, no EHOSTUNREACH. On this kernel
(checked at 6.18, no netem, no tc classifiers, no nftables or iptables) the ways to get that:
  * `ip link set ... down` on a bridge port: silent at first, but ARP for an unresolved peer
    fails after ~3 s and connects then end with EHOSTUNREACH (measured), and the victim's
    `eth0` loses its carrier (a real partition leaves the link up);
  * bridge port states (blocking, disabled) were not applied by this kernel.
So every namespace holds a permanent ARP entry for every peer (no ARP traffic ever, so no
ARP failure), and a partition of A from B points A's entry for B, and B's for A, to a MAC
address no namespace owns: the bridge floods those frames to ports whose owners drop them.
The pair is cut both ways, every other pair is untouched, links and carriers stay up, and
healing puts the real MAC addresses back: connections that waited resume (TCP retransmits),
as after a real partition. tests/chaos/net/test_netns.py checks that a connect across a cut
times out (past ARP's 3 s), that an open connection's bytes wait and arrive after the heal,
that other pairs still talk, and that `close` leaves no namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.77.0"
FIRST_HOST = 10  # role i is SUBNET.(FIRST_HOST + i)
NOBODY_MAC = "02:6d:73:ff:ff:ff"  # locally administered; no namespace has it
CLONE_NEWNET = 0x40000000
STALE = re.compile(r"^ms(\d+)-")


def _ip(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process left in `ns` (a service's children, a leftover of a crash)."""
    with contextlib.suppress(RuntimeError):
        for pid in _ip("netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Delete the namespaces of harnesses that died without cleaning up (`ms<pid>-*` whose
    pid is gone), killing what still runs in them. Returns their names."""
    stale = [
        ns
        for ns in namespaces()
        if (m := STALE.match(ns)) and int(m[1]) != os.getpid() and not _alive(int(m[1]))
    ]
    for ns in stale:
        _kill_inside(ns)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", ns)
    return stale


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): the harness skips with it."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or skip the network-partition tier)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"ms{os.getpid()}-can"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
    except RuntimeError as err:
        return f"cannot create a network namespace with a bridge here: {err}"
    finally:
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", probe)
    return None


class Partition:
    """One partition: `pairs` cut until `heal()` (by its timer after `seconds`, or earlier)."""

    def __init__(self, net: Network, pairs: list[tuple[str, str]], seconds: float):
        self.net = net
        self.pairs = pairs
        self.seconds = seconds
        self.healed = threading.Event()
        self._once = threading.Lock()  # its timer and a caller may heal it at the same time
        self._timer = threading.Timer(seconds, self.heal)
        self._timer.daemon = True
        net._cut(pairs)
        self._timer.start()

    def heal(self) -> None:
        with self._once:
            if not self.healed.is_set():
                self._timer.cancel()
                self.net._heal(self.pairs)
                self.healed.set()

    def wait(self) -> None:
        self.healed.wait()

    def _forget(self) -> None:
        """Its network is being deleted: stop the timer, which would otherwise rewrite the
        entries of the next network this process makes (same prefix, maybe other roles)."""
        with self._once:
            self._timer.cancel()
            self.healed.set()


class Network:
    """The namespaces of `roles`, wired to one bridge; see the module docstring."""

    def __init__(self, roles: Sequence[str]):
        if len(set(roles)) != len(roles) or len(roles) > 200:
            raise ValueError(f"roles must be distinct and at most 200: {roles}")
        clean_stale()
        self.prefix = f"ms{os.getpid()}"
        self.roles = list(roles)
        self.bridge_ns = f"{self.prefix}-net"
        self._cuts: Counter[frozenset[str]] = Counter()
        self._lock = threading.Lock()
        self._created: list[str] = []
        self._partitions: list[Partition] = []
        atexit.register(self.close)  # also when the caller never reaches its `finally`
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def address(self, role: str) -> str:
        return f"{SUBNET}.{FIRST_HOST + self.roles.index(role)}"

    def mac(self, role: str) -> str:
        return f"02:6d:73:00:00:{self.roles.index(role) + 1:02x}"

    def argv(self, role: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `role`'s namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns(role), *argv]

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, role in enumerate(self.roles):
            ns = self.ns(role)
            self._add_ns(ns)
            port = f"v{i}"
            _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name",
                "eth0", "address", self.mac(role), "netns", ns)  # fmt: skip
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(role)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        for role in self.roles:
            self._set_neighbours(role, {p: self.mac(p) for p in self.roles if p != role})

    def _set_neighbours(self, role: str, macs: dict[str, str]) -> None:
        lines = [
            f"neigh replace {self.address(p)} lladdr {mac} dev eth0 nud permanent"
            for p, mac in macs.items()
        ]
        _ip("-n", self.ns(role), "-batch", "-", stdin="\n".join(lines) + "\n")

    def pairs(self, roles: str | Iterable[str], peers: Iterable[str] | None = None):
        """Every (role, peer) pair between `roles` and `peers` (default: every other role)."""
        side = [roles] if isinstance(roles, str) else list(roles)
        others = [r for r in (self.roles if peers is None else peers) if r not in side]
        for role in (*side, *others):
            if role not in self.roles:
                raise ValueError(f"no role {role!r} in {self.roles}")
        return list(itertools.product(side, others))

    def partition(
        self, roles: str | Iterable[str], seconds: float, *, peers: Iterable[str] | None = None
    ) -> Partition:
        """Cut `roles` from `peers` (default: from everything else) for `seconds`, both ways,
        in silence; returns at once with the partition (its timer heals it)."""
        partition = Partition(self, self.pairs(roles, peers), seconds)
        self._partitions.append(partition)
        return partition

    def _cut(self, pairs: list[tuple[str, str]]) -> None:
        self._apply(pairs, +1)

    def _heal(self, pairs: list[tuple[str, str]]) -> None:
        self._apply(pairs, -1)

    def _apply(self, pairs: list[tuple[str, str]], step: int) -> None:
        """Count each pair's cuts (partitions may overlap); rewrite the ARP entries of pairs
        whose count went from 0 to 1 (to nobody) or from 1 to 0 (back to the real MAC)."""
        with self._lock:
            changed: dict[str, dict[str, str]] = {}
            for a, b in pairs:
                key = frozenset((a, b))
                before = self._cuts[key]
                self._cuts[key] = max(0, before + step)
                if (before == 0) != (self._cuts[key] == 0):
                    for x, y in ((a, b), (b, a)):
                        changed.setdefault(x, {})[y] = NOBODY_MAC if step > 0 else self.mac(y)
            for role, macs in changed.items():
                self._set_neighbours(role, macs)

    def call_in(self, role: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` in a thread moved into `role`'s namespace (a network
        namespace belongs to a thread, so the caller's stays as it is); its sockets are made
        there. Returns its result or raises its exception."""
        out: dict[str, object] = {}

        def run() -> None:
            try:
                fd = os.open(f"/run/netns/{self.ns(role)}", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.ns(role)}")
                finally:
                    os.close(fd)
                out["value"] = fn(*args, **kwargs)
            except BaseException as err:  # handed to the caller
                out["error"] = err

        thread = threading.Thread(target=run, name=f"netns-{role}", daemon=True)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out["value"]  # type: ignore[return-value]

    def close(self) -> None:
        """Kill every process left in the namespaces and delete them (the bridge's last,
        which takes the veth pairs with it). Idempotent."""
        for partition in self._partitions:
            partition._forget()
        for ns in reversed(self._created):
            _kill_inside(ns)
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
        self._created.clear()
