"""The emulated cluster's network: namespaces, a bridge, every port shaped with tbf."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

__all__ = ["EmulateError", "preflight", "tc_rate", "up", "down", "cluster", "network_label", "MAX_RANKS", "SUBNET",
           "EXIT_PRECONDITION", "EXIT_TIMEOUT"]

#: The ranks' addresses are ``SUBNET.{r+1}``, visible only inside the namespaces.
SUBNET = "10.77.0"
#: A /24 has 253 usable host addresses after the network and broadcast ones.
MAX_RANKS = 253
#: Exit status of precondition failures (as argparse uses for usage errors).
EXIT_PRECONDITION = 2
#: Exit status when the timeout killed the ranks (as coreutils ``timeout`` does).
EXIT_TIMEOUT = 124

_ROOT_MESSAGE = ("sparsecomm emulate needs root (network namespaces); run it as root or use "
                 "--launcher spawn")
# tbf's burst must hold at least one rate/HZ worth of bytes; 512 kB does up to tens of Gbit/s,
# and 50 ms of queue keeps TCP from seeing drops at the emulated rates.
_TBF = ("burst", "512kb", "latency", "50ms")


class EmulateError(RuntimeError):
    """A precondition of the emulated cluster failed (not root, no iproute2, no tbf, bad input).

    ``exit_code`` is what the command returns for it (2), so callers can print
    the message and exit without a traceback.
    """

    exit_code = EXIT_PRECONDITION


def _is_root() -> bool:
    # A function of its own so tests can take the not-root path without dropping privileges.
    return os.geteuid() == 0


def network_label(P: int, rate: str, ranks_per_node: int = 1) -> str:
    """The ``SPARSECOMM_NETWORK`` label of an emulated cluster, e.g. ``"emulated 1gbit tbf, P=4"``
    (``"..., P=4, 2 a node"`` with nodes of several ranks)."""
    return f"emulated {rate} tbf, P={P}" + (f", {ranks_per_node} a node" if ranks_per_node > 1 else "")


def preflight(P: int, rate: str | None = None) -> None:
    """Check what the emulated cluster needs before touching anything.

    1. Root (creating network namespaces needs ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``).
    2. iproute2's ``ip`` and ``tc`` on ``PATH``.
    3. ``1 <= P <= MAX_RANKS`` (one address of the /24 per rank) and a rate
       that looks like a tc rate (``1gbit``, ``100mbit``, ``125mbps``); tc
       itself has the last word in :func:`up`.

    Args:
        P: number of ranks (namespaces).
        rate: the tbf rate, or None to skip that check.

    Raises:
        EmulateError: with a message meant for the user, if anything is missing.
    """
    if not _is_root():
        raise EmulateError(_ROOT_MESSAGE)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulateError(f"sparsecomm emulate needs iproute2 ({' and '.join(missing)} not found on PATH)")
    if not 1 <= P <= MAX_RANKS:
        raise EmulateError(f"sparsecomm emulate: --ranks must be between 1 and {MAX_RANKS}, got {P}")
    if rate is not None:
        try:
            tc_rate(rate)
        except ValueError as exc:
            raise EmulateError(f"sparsecomm emulate: {exc}") from None


def tc_rate(rate: str) -> str:
    """``rate`` if it looks like a tc rate (``1gbit``, ``100mbit``, ``125mbps``), else ValueError."""
    if not re.fullmatch(r"\d+(\.\d+)?([kmgt]?(bit|bps)|[kmgt]?)", rate.lower()):
        raise ValueError(f"{rate!r} is not a tc rate (e.g. 1gbit, 100mbit, 125mbps)")
    return rate


def _switch(prefix: str) -> tuple[str, str]:
    # Rank namespaces are f"{prefix}{r}"; the switch namespace is f"{prefix}sw" and its bridge f"{prefix}br0".
    return f"{prefix}sw", f"{prefix}br0"


def _ip(*args: str) -> None:
    """Run one ``ip``/``tc`` command; raise EmulateError with its stderr if it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulateError(f"sparsecomm emulate: `{' '.join(args)}` failed: {proc.stderr.strip()}")


def _namespaces() -> list[str]:
    """Names of the existing network namespaces (``ip netns list`` prints ``NAME [(id: N)]``)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def up(P: int, rate: str, prefix: str = "sc", hosts: bool = True) -> None:
    """Create the emulated cluster: P rank namespaces joined by a bridge, every port shaped to ``rate``.

    1. Check the preconditions (:func:`preflight`).
    2. Make the switch namespace ``{prefix}sw`` with the bridge ``{prefix}br0``.
    3. For every rank r: make namespace ``{prefix}{r}`` and a veth pair created
       directly in its two namespaces (``{prefix}v{r}`` in the rank's,
       ``{prefix}p{r}`` on the bridge), so no half-made port is ever left in the
       caller's namespace; give it ``10.77.0.{r+1}/24`` and bring up ``lo`` too.
    4. Shape both directions with tbf: the rank's egress (its injection
       bandwidth) and the switch port's egress (its ejection bandwidth).
    5. With ``hosts``, write ``/etc/netns/{prefix}{r}/hosts`` naming every rank
       (``ip netns exec`` bind-mounts it over ``/etc/hosts``): MPI's launcher
       resolves ``{prefix}{q}``, gloo's reverse look-ups of peers succeed
       instead of timing out, and the machine's host name resolves to the
       rank's own address, which is reachable from the other ranks.

    On failure the caller is expected to call :func:`down` (``cluster`` does).

    Args:
        P: number of ranks.
        rate: tbf rate of every port, in tc syntax (``1gbit``, ``10gbit``).
        prefix: name prefix of namespaces and interfaces (keep it short:
            interface names have at most 15 characters).
        hosts: write the per-namespace hosts files.

    Raises:
        EmulateError: a precondition failed or an ``ip``/``tc`` command did;
            a failing tc says whether tbf is unavailable or the rate invalid.
    """
    preflight(P, rate)
    switch, bridge = _switch(prefix)
    _ip("ip", "netns", "add", switch)
    _ip("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
    _ip("ip", "-n", switch, "link", "set", bridge, "up")
    for r in range(P):
        ns, port, peer = f"{prefix}{r}", f"{prefix}v{r}", f"{prefix}p{r}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", port, "netns", ns, "type", "veth", "peer", "name", peer, "netns", switch)
        _ip("ip", "-n", switch, "link", "set", peer, "master", bridge)
        _ip("ip", "-n", switch, "link", "set", peer, "up")
        _ip("ip", "-n", ns, "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", port)
        _ip("ip", "-n", ns, "link", "set", port, "up")
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
        for where, dev in ((ns, port), (switch, peer)):
            tc = subprocess.run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, *_TBF],
                                capture_output=True, text=True)
            if tc.returncode != 0:
                # The usual causes: no sch_tbf in this kernel (e.g. a container without the
                # module), or a rate tc does not accept. Say so, with tc's own words.
                raise EmulateError(f"sparsecomm emulate: tc could not shape {dev} with tbf at rate {rate!r} "
                                   f"(tbf unavailable in this kernel, or a rate tc rejects): "
                                   f"{tc.stderr.strip().splitlines()[0] if tc.stderr.strip() else tc.returncode}")
    if hosts:
        lines = "".join(f"{SUBNET}.{q + 1}\t{prefix}{q}\n" for q in range(P))
        for r in range(P):
            d = Path("/etc/netns") / f"{prefix}{r}"
            try:
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(f"127.0.0.1\tlocalhost\n{SUBNET}.{r + 1}\t{socket.gethostname()}\n"
                                         f"{lines}")
            except OSError as e:
                raise EmulateError(f"sparsecomm emulate: cannot write {d / 'hosts'}: {e}") from None


def down(P: int | None = None, prefix: str = "sc") -> None:
    """Remove the emulated cluster; idempotent, ignores what does not exist.

    1. Delete the rank namespaces ``{prefix}0 .. {prefix}{P-1}`` (with
       ``P=None``: every existing namespace named ``{prefix}<number>``, i.e.
       leftovers of any earlier size) and the switch namespace. Deleting a
       namespace destroys its veth ends, and so the pairs.
    2. Remove the hosts files :func:`up` may have written under ``/etc/netns``.

    Processes still running inside a namespace keep it alive after its name is
    gone, so stop the ranks first.

    Args:
        P: number of ranks to remove, or None for all leftovers with this prefix.
        prefix: the prefix given to :func:`up`.
    """
    switch, _ = _switch(prefix)
    if P is None:
        pattern = re.compile(re.escape(prefix) + r"\d+")
        ranks = [name for name in _namespaces() if pattern.fullmatch(name)]
    else:
        ranks = [f"{prefix}{r}" for r in range(P)]
    for name in [*ranks, switch]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through every finally (and cluster's teardown) as Ctrl-C does.
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def cluster(P: int, rate: str, prefix: str = "sc", hosts: bool = True) -> Iterator[None]:
    """Bring the emulated cluster up for the ``with`` block and always tear it down.

    1. Hold the prefix's lock (:func:`_owning`: a second cluster of this prefix waits), then
       remove leftovers with this prefix (of a crashed run, or of another size).
    2. :func:`up`; install a SIGTERM handler that raises ``SystemExit`` (in the
       main thread only: Python allows no handlers elsewhere), so a ``kill``
       still tears down.
    3. Yield; finally :func:`down` and restore the previous SIGTERM handler,
       also after an exception, Ctrl-C or SIGTERM.

    Args:
        P: number of ranks.
        rate: tbf rate of every port.
        prefix: namespace and interface name prefix.
        hosts: write the per-namespace hosts files (see :func:`up`).

    Raises:
        EmulateError: a precondition failed (nothing is left behind).
    """
    preflight(P, rate)
    with _owning(prefix):
        down(None, prefix)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main_thread else None
        try:
            up(P, rate, prefix, hosts=hosts)
            yield
        finally:
            down(None, prefix)
            if main_thread:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _owning(prefix: str) -> Iterator[None]:
    """Hold the prefix's lock for the ``with`` block: one cluster a prefix at a time.

    A second run with the same prefix would take the first's namespaces for a crashed run's
    leftovers and delete them under its ranks; it waits here instead (saying so once). The
    lock is a ``flock`` on a file in /run/lock, released by the kernel when its holder exits,
    so a run that crashed never blocks the next one (whose step 1 then removes its leftovers).
    """
    folder = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
    with open(folder / f"sparsecomm-emulate-{prefix}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            print(f"sparsecomm emulate: waiting for the cluster of prefix {prefix!r} ({holder}) to come down",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
