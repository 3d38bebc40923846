"""Several hosts on one Linux machine, for multi-node runs without a cluster: each host is a network
namespace on a private bridge, with its own hostname, ``/etc/hosts``, ``/tmp`` and ``/dev/shm``.

Hosts share no filesystem the job writes to: a host's ``/tmp`` and ``/dev/shm`` are its own
folders, bind-mounted in a mount namespace of each command (the machine's software, such as the
Python environment, is visible to every host, as an image installed on every node would be). Files a
job needs are copied into the host's working directory ``/tmp/work`` (:meth:`Testbed.put`); what a
host wrote is read back from outside through :meth:`Testbed.host_path`. ``/etc/hosts`` names every
host, so a launcher that hands out hostnames (torchrun's c10d rendezvous) works as on a cluster.

Faults are operations on a running testbed: cut a host's link for some seconds, limit its rate
(``tc`` token bucket), kill every process of a host.

Needs root, ``ip`` (iproute2), ``unshare``, ``mount`` and ``tc``; where one is missing
:func:`check_available` raises :class:`TestbedUnavailable` with the reason. Every name a run
creates carries its tag, the pid of the process that created it and a counter
(``dsm<pid hex>-<n hex>...``), so runs in parallel do not collide; teardown (the context manager's
exit, and at exit of the process) removes them and checks that nothing is left
(:meth:`Testbed.leftovers`).

Two hosts, one torchrun each, two ranks per host, static rendezvous::

    sudo python launch/multihost.py --hosts 2 --copy distscaler launch configs \\
        --fetch runs/mh -- python -m torch.distributed.run --nnodes 2 --node-rank {node_rank} \\
        --nproc-per-node 2 --master-addr {host0} --master-port 29500 \\
        launch/train.py --config configs/smoke.yaml --steps 6 --out runs/mh

``{node_rank}``, ``{hostname}``, ``{addr}``, ``{host0}`` (the first host's address) and
``{num_hosts}`` are filled in per host. Leftovers of runs killed before their teardown::

    sudo python launch/multihost.py --check          # lists them (exit code 1 if any)
    sudo python launch/multihost.py --clean-stale    # removes those whose process is gone
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "NAME_PREFIX",
    "WORKDIR",
    "Host",
    "HostProcess",
    "TeardownIncomplete",
    "Testbed",
    "TestbedUnavailable",
    "check_available",
    "clean_stale",
    "leftovers",
]

#: First characters of every interface and namespace name a run creates.
NAME_PREFIX = "dsm"
#: A host's working directory, inside the host (outside: ``Testbed.host_path(host, WORKDIR)``).
WORKDIR = "/tmp/work"
#: The commands the testbed runs on the machine.
TOOLS = ("ip", "unshare", "mount", "tc", "sh")
#: Interface names are limited to 15 characters by the kernel.
_MAX_HOSTS = 64
_COMMAND_TIMEOUT_S = 30.0
_settle_timeout_s = 10.0
_counter = 0
_counter_lock = threading.Lock()


class TestbedUnavailable(RuntimeError):
    """This machine cannot host a testbed; ``reason`` says why (not root, a tool missing,
    namespaces not permitted...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TeardownIncomplete(RuntimeError):
    """Teardown left namespaces, links, processes or files behind; ``leftovers`` names them."""

    def __init__(self, leftovers: list[str]) -> None:
        super().__init__("testbed teardown left: " + "; ".join(leftovers))
        self.leftovers = leftovers


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One command of the machine's setup (``ip``, ``tc``...), bounded in time."""
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def check_available() -> None:
    """Raises :class:`TestbedUnavailable` unless this process can build a testbed: Linux, root,
    the tools of ``TOOLS`` on PATH, and network and mount namespaces permitted (probed with one
    ``unshare``)."""
    if not sys.platform.startswith("linux"):
        raise TestbedUnavailable(f"needs Linux network namespaces, this is {sys.platform}")
    if os.geteuid() != 0:
        raise TestbedUnavailable(
            f"needs root (network namespaces, bridges, mounts), running as uid {os.geteuid()}"
        )
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise TestbedUnavailable(f"needs {', '.join(missing)} on PATH (iproute2, util-linux)")
    try:
        probe = _sh("unshare", "--net", "--mount", "--uts", "true", check=False)
    except subprocess.TimeoutExpired:
        raise TestbedUnavailable("`unshare --net --mount --uts true` did not return") from None
    if probe.returncode != 0:
        raise TestbedUnavailable(
            f"cannot create network/mount namespaces here (`unshare --net --mount --uts true`: "
            f"{probe.stderr.strip() or f'exit {probe.returncode}'})"
        )


@dataclass(frozen=True, slots=True)
class Host:
    """One host of a testbed."""

    index: int
    """Position in ``Testbed.hosts``; the node rank of a job with one launcher per host."""
    hostname: str
    """``host<index>``; every host's ``/etc/hosts`` resolves it to ``addr``."""
    addr: str
    """IPv4 address on the bridge (``eth0`` inside the host)."""
    netns: str
    """Network namespace (``ip netns exec NETNS ...``)."""
    link: str
    """The machine's end of the host's veth pair (on the bridge); a cut takes it down."""
    disk: Path
    """The host's own folders, seen from outside: ``tmp`` (its ``/tmp``) and ``shm``."""


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command may hold spaces and ")"
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (read from /proc)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(tree.get(p, []))
    return found


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class HostProcess:
    """A command running on a host (:meth:`Testbed.run`): its stdout and stderr go to ``log``.

    ``timeout`` (seconds from its start) bounds it: :meth:`wait` kills it (with every process it
    started) once that has passed.
    """

    def __init__(
        self, host: Host, argv: list[str], popen: subprocess.Popen, log: Path, timeout: float
    ) -> None:
        self.host = host
        self.argv = argv
        self.log = log
        self.timeout = timeout
        self.timed_out = False
        self._popen = popen
        self._deadline = time.monotonic() + timeout

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        """The exit code, or None while it runs; kills it once its timeout has passed."""
        if self._popen.poll() is None and time.monotonic() > self._deadline:
            self.timed_out = True
            self.kill()
        return self._popen.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the exit code, at most ``timeout`` seconds (None: until the process's own
        timeout, which kills it); raises :class:`subprocess.TimeoutExpired` when either passes."""
        until = (
            self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
        )
        while self.poll() is None:
            if time.monotonic() > until:
                raise subprocess.TimeoutExpired(self.argv, timeout or self.timeout)
            time.sleep(0.05)
        if self.timed_out:
            raise subprocess.TimeoutExpired(self.argv, self.timeout, output=self.output())
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL to the command and every process it started that is still its descendant;
        reaps it. (One that outlived its parent is ended by :meth:`Testbed.kill_host`.)"""
        for _ in range(3):  # a process may fork while the tree is read
            tree = _process_tree(self._popen.pid) if self._popen.poll() is None else []
            if not tree:
                break
            _kill(tree)
            time.sleep(0.05)
        try:
            self._popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _host_script(host: Host, hosts_file: Path, run_dir: Path, cwd: str) -> str:
    """What runs first in a command's own mount and UTS namespaces: the host's /etc/hosts,
    /dev/shm and /tmp, the other hosts' folders out of sight, its hostname, its working dir."""
    q = shlex.quote
    return "\n".join(
        [
            "set -e",
            f"mount --bind {q(str(hosts_file))} /etc/hosts",
            f"mount --bind {q(str(host.disk / 'shm'))} /dev/shm",
            f"mount --bind {q(str(host.disk / 'tmp'))} /tmp",
            # Where the run's folder is not under /tmp, it is still in sight: cover it.
            f"if [ -d {q(str(run_dir))} ]; then mount -t tmpfs none {q(str(run_dir))}; fi",
            f"hostname {q(host.hostname)}",
            f"mkdir -p {q(cwd)}",
            f"cd {q(cwd)}",
            'exec "$@"',
        ]
    )


def _netns_inode(netns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def _pids_in_netns(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino in inodes:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _names(kind: str) -> list[str]:
    """Names of network namespaces (``kind="netns"``) or links (``"link"``) starting with
    ``NAME_PREFIX``."""
    if kind == "netns":
        lines = _sh("ip", "netns", "list").stdout.splitlines()
        names = [line.split()[0] for line in lines if line.strip()]
    else:
        lines = _sh("ip", "-o", "link", "show").stdout.splitlines()
        names = [line.split(":")[1].strip().split("@")[0] for line in lines if ":" in line]
    return [n for n in names if n.startswith(NAME_PREFIX)]


# A run's tag is "<pid hex>-<counter hex>"; what follows it in a name starts with a letter that
# is no hex digit (s: the bridge, h: a namespace, v, p: a veth pair), in a folder's name with "-".
_NAME = re.compile(rf"^{NAME_PREFIX}(?P<tag>[0-9a-f]+-[0-9a-f]+)[g-z]")
_FOLDER = re.compile(r"^distscaler-multihost-(?P<tag>[0-9a-f]+-[0-9a-f]+)-")


def _tag_of(name: str) -> str | None:
    """The tag of the run that created the namespace, link or folder ``name``; None: no run's."""
    match = _NAME.match(name) or _FOLDER.match(name)
    return match["tag"] if match else None


def _run_items(tag: str | None) -> list[tuple[str, str]]:
    """(kind, name) of every namespace, link and folder of the run ``tag``, or of every run."""
    items = [("network namespace", n) for n in _names("netns")]
    items += [("link", n) for n in _names("link")]
    items += [("folder", str(p)) for p in sorted(Path(tempfile.gettempdir()).glob("distscaler-*"))]
    return [
        (kind, name)
        for kind, name in items
        if (found := _tag_of(Path(name).name)) is not None and (tag is None or found == tag)
    ]


def leftovers(tag: str | None = None) -> list[str]:
    """What testbeds left on this machine: network namespaces, links and run folders of the run
    ``tag`` (a :attr:`Testbed.tag`), or of every run when None."""
    return [f"{kind} {name}" for kind, name in _run_items(tag)]


@dataclass(eq=False)
class Testbed:
    """``num_hosts`` hosts on a bridge, addresses ``{subnet}.1``, ``{subnet}.2``...; a context
    manager (entering builds it, leaving tears it down and checks for leftovers).

    Args:
        num_hosts (int): number of hosts, 1 to 64.
        subnet (str): the first three octets of the hosts' /24 (default ``"10.213.0"``). The
            bridge carries no address of the machine's, so runs may use the same subnet.
        command_timeout_s (float): default bound of a :meth:`run`, in seconds (default 300).
    """

    num_hosts: int
    subnet: str = "10.213.0"
    command_timeout_s: float = 300.0
    hosts: list[Host] = field(default_factory=list, init=False)
    tag: str = field(default="", init=False)
    run_dir: Path | None = field(default=None, init=False)
    _processes: list[HostProcess] = field(default_factory=list, init=False)
    _timers: list[threading.Thread] = field(default_factory=list, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _inodes: set[int] = field(default_factory=set, init=False)
    _torn_down: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_hosts <= _MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {_MAX_HOSTS}], got: {self.num_hosts}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ValueError(
                f"subnet must be three octets such as '10.213.0', got: {self.subnet!r}"
            )

    # ----------------------------------------------------------------------------- build

    @property
    def bridge(self) -> str:
        return f"{NAME_PREFIX}{self.tag}s"

    def start(self) -> Testbed:
        """Builds the bridge, the hosts and their folders; on any failure removes what it built
        and raises (:class:`TestbedUnavailable` where the machine cannot do it)."""
        global _counter
        if self.tag:
            raise RuntimeError("this testbed was started already; a Testbed starts once")
        check_available()
        with _counter_lock:
            self.tag = f"{os.getpid():x}-{_counter:x}"
            _counter += 1
        atexit.register(self.teardown)
        try:
            self._build()
        except BaseException as e:
            try:
                self.teardown()
            except TeardownIncomplete as incomplete:
                raise incomplete from e
            if isinstance(e, RuntimeError) and not isinstance(e, TestbedUnavailable):
                raise TestbedUnavailable(f"could not build the testbed: {e}") from e
            raise
        return self

    def _build(self) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"distscaler-multihost-{self.tag}-"))
        (self.run_dir / "logs").mkdir()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.num_hosts):
            host = Host(
                index=i,
                hostname=f"host{i}",
                addr=f"{self.subnet}.{i + 1}",
                netns=f"{NAME_PREFIX}{self.tag}h{i}",
                link=f"{NAME_PREFIX}{self.tag}v{i}",
                disk=self.run_dir / f"host{i}",
            )
            for folder in ("tmp/work", "shm"):
                (host.disk / folder).mkdir(parents=True)
            self.hosts.append(host)
            peer = f"{NAME_PREFIX}{self.tag}p{i}"
            _sh("ip", "netns", "add", host.netns)
            inode = _netns_inode(host.netns)
            if inode is not None:
                self._inodes.add(inode)
            _sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", peer, "netns", host.netns)
            _sh("ip", "link", "set", host.link, "master", self.bridge)
            _sh("ip", "link", "set", host.link, "up")
            ns = ("ip", "-n", host.netns)
            _sh(*ns, "link", "set", peer, "name", "eth0")
            _sh(*ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _sh(*ns, "link", "set", "eth0", "up")
            _sh(*ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost"] + [f"{h.addr} {h.hostname}" for h in self.hosts]
        (self.run_dir / "hosts").write_text("\n".join(lines) + "\n")

    def __enter__(self) -> Testbed:
        return self if self.tag else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    # ------------------------------------------------------------------------ use

    def host_path(self, host: Host, path: str = WORKDIR) -> Path:
        """Where the host's ``path`` (under its ``/tmp`` or ``/dev/shm``) lies, seen from
        outside."""
        p = Path(path)
        for inside, outside in (("/tmp", "tmp"), ("/dev/shm", "shm")):
            if p == Path(inside) or Path(inside) in p.parents:
                return host.disk / outside / p.relative_to(inside)
        raise ValueError(f"path must be under /tmp or /dev/shm (a host's own folders), got: {path}")

    def put(self, host: Host, src: str | os.PathLike[str], dest: str | None = None) -> Path:
        """Copies the file or folder ``src`` into the host's working directory, as ``dest``
        (relative to it; default: ``src``'s name). Returns the copy, seen from outside."""
        src = Path(src)
        target = self.host_path(host) / (dest if dest is not None else src.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
            shutil.copytree(src, target, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)
        return target

    def run(
        self,
        host: Host,
        cmd: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        cwd: str = WORKDIR,
    ) -> HostProcess:
        """Starts ``cmd`` (an argv, or a string for ``sh -c``) on ``host`` in the background.

        It starts from a clean environment (``PATH``, ``HOME=/tmp``, ``LANG``) plus ``env``, in
        ``cwd`` (created if missing), with the host's hostname and folders; stdout and stderr go to
        ``HostProcess.log``. ``timeout``: seconds (default ``command_timeout_s``).
        """
        if self.run_dir is None or self._torn_down:
            raise RuntimeError("the testbed is not running: use it inside `with Testbed(...)`")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        script = _host_script(host, self.run_dir / "hosts", self.run_dir, cwd)
        full = [
            "ip",
            "netns",
            "exec",
            host.netns,
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "LANG": "C.UTF-8"}
        log = self.run_dir / "logs" / f"{host.hostname}-{len(self._processes)}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                full,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**base, **(env or {})},
                start_new_session=True,
            )
        proc = HostProcess(host, argv, popen, log, timeout or self.command_timeout_s)
        self._processes.append(proc)
        return proc

    # ----------------------------------------------------------------------------- faults

    def link_down(self, host: Host) -> None:
        """Takes the host's link down: nothing reaches it or leaves it until :meth:`link_up`."""
        _sh("ip", "link", "set", host.link, "down")

    def link_up(self, host: Host) -> None:
        _sh("ip", "link", "set", host.link, "up")

    def cut_link(self, host: Host, seconds: float) -> threading.Thread:
        """Takes the host's link down now and up again after ``seconds`` (in a thread, returned:
        ``join()`` it to wait for the restore; teardown ends it early)."""
        self.link_down(host)

        def restore() -> None:
            self._stop.wait(seconds)
            if not self._torn_down:
                self.link_up(host)

        timer = threading.Thread(target=restore, name=f"restore-{host.hostname}", daemon=True)
        timer.start()
        self._timers.append(timer)
        return timer

    def rate_limit(
        self, host: Host, rate: str, *, burst: str = "32kbit", latency: str = "400ms"
    ) -> None:
        """Limits the host's link to ``rate`` (tc units: ``"10mbit"``) both ways, a token bucket
        (``tc-tbf``) of ``burst`` whose queue holds ``latency`` worth of packets."""
        spec = ("root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        _sh("tc", "qdisc", "replace", "dev", host.link, *spec)
        _sh("ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0", *spec)

    def clear_rate_limit(self, host: Host) -> None:
        _sh("tc", "qdisc", "del", "dev", host.link, "root", check=False)
        _sh(
            "ip",
            "netns",
            "exec",
            host.netns,
            "tc",
            "qdisc",
            "del",
            "dev",
            "eth0",
            "root",
            check=False,
        )

    def host_pids(self, host: Host) -> list[int]:
        """Every process running on the host (in its network namespace)."""
        out = _sh("ip", "netns", "pids", host.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> int:
        """SIGKILL to every process of the host, as a crash of the machine would; returns how
        many there were. Its folders stay, as a disk would; it can run commands again."""
        killed: set[int] = set()
        deadline = time.monotonic() + _settle_timeout_s
        while (pids := self.host_pids(host)) and time.monotonic() < deadline:
            _kill(pids)
            killed.update(pids)
            time.sleep(0.05)
        for proc in self._processes:
            if proc.host == host:
                proc.poll()  # reaps the ones started here
        return len(killed)

    # --------------------------------------------------------------------------- teardown

    def leftovers(self) -> list[str]:
        """What of this run is still on the machine: processes in its hosts' namespaces,
        namespaces, links, its folder. Empty after a complete teardown."""
        found = [f"process {pid}" for pid in _pids_in_netns(self._inodes)] if self._inodes else []
        return found + leftovers(self.tag) if self.tag else found

    def teardown(self) -> None:
        """Kills every process of the hosts, deletes the namespaces, links and folders, then
        checks that none is left (:class:`TeardownIncomplete` names what is). Idempotent."""
        if self._torn_down or not self.tag:
            return
        self._torn_down = True
        atexit.unregister(self.teardown)
        self._stop.set()
        for timer in self._timers:
            timer.join(timeout=_COMMAND_TIMEOUT_S)
        for host in self.hosts:
            self.kill_host(host)
        # Commands whose namespace was never entered (killed before `ip netns exec` ran).
        for proc in self._processes:
            if proc.poll() is None:
                proc.kill()
        for host in self.hosts:
            _sh("ip", "netns", "del", host.netns, check=False)
            _sh("ip", "link", "del", host.link, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        deadline = time.monotonic() + _settle_timeout_s  # the kernel frees namespaces lazily
        while (left := self.leftovers()) and time.monotonic() < deadline:
            _kill([int(item.split()[1]) for item in left if item.startswith("process ")])
            time.sleep(0.1)
        if left:
            raise TeardownIncomplete(left)


def clean_stale(tag: str | None = None) -> list[str]:
    """Removes what testbeds left whose process no longer runs (one killed before its teardown
    could run): of the run ``tag``, or of every run when None. Returns what it removed.

    A run is told by the pid in its names: use it where every testbed's process is in this
    process's pid namespace."""
    removed = []
    for kind, name in _run_items(tag):
        run_tag = _tag_of(Path(name).name)
        assert run_tag is not None
        if Path(f"/proc/{int(run_tag.split('-')[0], 16)}").exists():
            continue  # its process runs: its own teardown removes it
        if kind == "network namespace":
            _kill([int(p) for p in _sh("ip", "netns", "pids", name, check=False).stdout.split()])
            _sh("ip", "netns", "del", name, check=False)
        elif kind == "link":
            _sh("ip", "link", "del", name, check=False)  # gone already if its peer's netns is
        else:
            shutil.rmtree(name, ignore_errors=True)
        removed.append(f"{kind} {name}")
    return removed


# ------------------------------------------------------------------------------------- CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run a command on every host of a testbed of network namespaces (one "
        "machine, several hosts, no shared filesystem), then tear it down. Needs root.",
        epilog="In the command, {node_rank}, {hostname}, {addr}, {host0} (the first host's "
        "address) and {num_hosts} are filled in per host.",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default: 2)")
    parser.add_argument("--subnet", default="10.213.0", help="first three octets of the hosts' /24")
    parser.add_argument(
        "--copy",
        nargs="+",
        default=[],
        metavar="PATH",
        help="files or folders copied into every host's working directory",
    )
    parser.add_argument(
        "--fetch",
        metavar="PATH",
        help="a path in host 0's working directory copied here after the run",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (default: 600)")
    parser.add_argument("--rate-limit", metavar="RATE", help="every host's link, e.g. 100mbit")
    parser.add_argument(
        "--cut-link",
        metavar="HOST:AT:SECONDS",
        help="take host HOST's link down AT seconds after the start, for SECONDS",
    )
    parser.add_argument(
        "--kill-host",
        metavar="HOST:AT",
        help="kill every process of host HOST AT seconds after the start",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only list what earlier runs left (exit code 1 if anything)",
    )
    parser.add_argument(
        "--clean-stale",
        action="store_true",
        help="only remove what runs whose process is gone left",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not (args.command or args.check or args.clean_stale):
        parser.error("a command is required (after --)")
    return args


def _numbers(text: str, count: int, option: str) -> list[float]:
    parts = text.split(":")
    try:
        if len(parts) != count:
            raise ValueError
        return [float(p) for p in parts]
    except ValueError:
        raise SystemExit(f"{option} expects {count} numbers joined by ':', got: {text!r}") from None


def _faults(args: argparse.Namespace, bed: Testbed) -> list[tuple[float, Callable[[], object]]]:
    """The CLI's faults: (seconds after the start, what to do), in order."""
    faults: list[tuple[float, Callable[[], object]]] = []
    if args.cut_link:
        host, at, seconds = _numbers(args.cut_link, 3, "--cut-link")
        faults.append((at, functools.partial(bed.cut_link, bed.hosts[int(host)], seconds)))
    if args.kill_host:
        host, at = _numbers(args.kill_host, 2, "--kill-host")
        faults.append((at, functools.partial(bed.kill_host, bed.hosts[int(host)])))
    return sorted(faults, key=lambda fault: fault[0])


def _exit_on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.check:
        found = leftovers()
        print("\n".join(found) or "nothing left")
        return 1 if found else 0
    if args.clean_stale:
        print("\n".join(clean_stale()) or "nothing to remove")
        return 0
    # A SIGTERM (a scheduler, timeout(1)) unwinds through the teardown like Ctrl-C; a second one
    # would cut the teardown short.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        bed = Testbed(args.hosts, subnet=args.subnet, command_timeout_s=args.timeout)
        bed.start()
    except TestbedUnavailable as e:
        print(f"multihost: cannot run here: {e.reason}", file=sys.stderr)
        return 2
    with bed:
        hosts = ", ".join(f"{h.hostname} {h.addr}" for h in bed.hosts)
        print(f"testbed {bed.tag}: {hosts}", flush=True)
        for host in bed.hosts:
            for path in args.copy:
                bed.put(host, path)
            if args.rate_limit:
                bed.rate_limit(host, args.rate_limit)
        procs = []
        for host in bed.hosts:
            fill = {
                "node_rank": host.index,
                "hostname": host.hostname,
                "addr": host.addr,
                "host0": bed.hosts[0].addr,
                "num_hosts": len(bed.hosts),
            }
            procs.append(
                bed.run(
                    host,
                    [part.format(**fill) for part in args.command],
                    env={"PYTHONPATH": WORKDIR},
                )
            )
        start = time.monotonic()
        pending = _faults(args, bed)
        while any(p.poll() is None for p in procs):
            while pending and time.monotonic() - start >= pending[0][0]:
                pending.pop(0)[1]()
            time.sleep(0.1)
        for proc in procs:
            print(
                f"===== {proc.host.hostname}: exit {proc.returncode}"
                f"{' (timed out)' if proc.timed_out else ''}\n{proc.output()}"
            )
        if args.fetch:
            src = bed.host_path(bed.hosts[0]) / args.fetch
            if src.exists():
                dest = Path(args.fetch).name
                if src.is_dir():
                    shutil.copytree(src, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, dest)
                print(f"fetched host0:{WORKDIR}/{args.fetch} -> {Path(dest).resolve()}")
            else:
                print(f"host0 has no {WORKDIR}/{args.fetch} to fetch", file=sys.stderr)
    print("testbed torn down; nothing left")
    codes = [p.returncode or 0 for p in procs]
    worst = next((c for c in codes if c != 0), 0)
    return 128 - worst if worst < 0 else worst  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main())
