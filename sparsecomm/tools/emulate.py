"""An emulated slow-link cluster on one machine: ``sparsecomm emulate``.

``run(P, "1gbit", ["python", "my_rank.py"], timeout=600)`` makes P network
namespaces ``sc0 .. sc{P-1}``, each with one veth port ``scv{r}`` (address
``10.77.0.{r+1}/24``) to a bridge that lives in its own namespace ``scsw``,
shapes both directions of every port to the rate with ``tbf`` (a rank's
injection and ejection bandwidth, as behind a non-blocking switch), starts one
process per rank inside its namespace with the usual torch.distributed
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), waits for them and
always removes the namespaces again. It needs root and iproute2; no latency is
added (``netem`` is not available everywhere ``tbf`` is). With ``mpi=True``
(``--mpi``) the ranks are instead one MPICH ``mpiexec`` job whose rank r runs
in namespace r and talks TCP over its shaped port.

From the command line (wired in ``sparsecomm.tools.cli``)::

    sparsecomm emulate --ranks 4 --rate 1gbit -- python -m pytest benchmarks/test_allreduce.py

Every rank sees ``SPARSECOMM_LAUNCHER=emulate`` and
``SPARSECOMM_NETWORK="emulated 1gbit tbf, P=4"``, which the benchmarks record
in their JSON so a result says which network it was measured on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Sequence

from .argtypes import checked_by, int_in, positive_float, positive_int

__all__ = ["EmulateError", "preflight", "tc_rate", "up", "down", "cluster", "run", "network_label",
           "add_arguments", "main", "MAX_RANKS", "SUBNET"]

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


def network_label(P: int, rate: str) -> str:
    """The ``SPARSECOMM_NETWORK`` label of an emulated cluster, e.g. ``"emulated 1gbit tbf, P=4"``."""
    return f"emulated {rate} tbf, P={P}"


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

    1. Remove leftovers with this prefix (of a crashed run, or of another size).
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


def _common_env(P: int, rate: str, port: int, threads: int) -> dict[str, str]:
    """Variables every rank gets in both modes (on top of the caller's environment)."""
    return dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads),
                SPARSECOMM_LAUNCHER="emulate", SPARSECOMM_NETWORK=network_label(P, rate))


def _rank_env(r: int, P: int, rate: str, port: int, threads: int, prefix: str,
              extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of gloo rank r: the caller's, the launcher's variables, then ``extra``."""
    env = dict(os.environ)
    env.update(_common_env(P, rate, port, threads), RANK=str(r), WORLD_SIZE=str(P),
               # gloo would otherwise pick the interface of the host name's address.
               GLOO_SOCKET_IFNAME=f"{prefix}v{r}")
    env.update(extra or {})
    return env


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill_inside(names: Sequence[str], sig: int) -> None:
    """Signal every process inside the namespaces ``names`` (``ip netns pids``).

    A process left inside keeps its namespace, and the veth in it, alive after
    ``ip netns del``; MPI's remote proxies are not in any process group we own.
    """
    for name in names:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        for pid in out.split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), sig)


def _stop(procs: Sequence[subprocess.Popen], namespaces: Sequence[str], grace: float = 3.0,
          signals: Sequence[int] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """Stop everything the ranks started: SIGTERM, then SIGKILL after ``grace`` seconds.

    1. Signal each launched process's group (each leads its own session, so
       this reaches its children, e.g. a data loader) and every process still
       inside the namespaces.
    2. Wait up to ``grace`` seconds for the launched processes to exit; then
       the same with SIGKILL, which cannot be ignored.
    """
    for sig in signals:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            _kill_group(p, sig)
        _kill_inside(namespaces, sig)
        deadline = time.monotonic() + grace
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs) and sig != signal.SIGKILL:
            # The launched processes are gone; a straggler inside a namespace still gets SIGKILL.
            _kill_inside(namespaces, signal.SIGKILL)
            return


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _say(message: str) -> None:
    print(f"sparsecomm emulate: {message}", file=sys.stderr, flush=True)


def _exit_status(code: int) -> int:
    # Popen reports death by signal N as -N; shells say 128 + N.
    return code if code >= 0 else 128 - code


class _GlooRanks:
    """One ``ip netns exec`` process per rank; their exit codes are the ranks'."""

    launcher = "the ranks"
    #: SIGTERM first: a torch rank may still flush its output or a checkpoint.
    signals = (signal.SIGTERM, signal.SIGKILL)

    def __init__(self, P: int, rate: str, command: list[str], threads: int, env: dict[str, str] | None,
                 logdir: Path, port: int, prefix: str, files: list[IO[bytes]]) -> None:
        self.procs: list[subprocess.Popen] = []
        for r in range(P):
            out: IO[bytes] | None = None
            if r > 0:
                out = open(logdir / f"rank{r}.log", "wb")
                files.append(out)
            # ip netns exec execs the command, so the Popen pid is the rank itself,
            # and start_new_session makes it the leader of a group we can kill whole.
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", f"{prefix}{r}", *command],
                env=_rank_env(r, P, rate, port, threads, prefix, env),
                stdout=out, stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL, start_new_session=True))

    def codes(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in enumerate(self.procs)}

    def launcher_exit(self) -> int | None:
        return None  # no launcher besides the ranks themselves

    def finish(self, deadline: float) -> int:
        return 0


# hydra's ssh launcher runs `LAUNCHER [-x] HOST COMMAND...`, and ssh hands COMMAND to the remote
# shell as one string: so does this, inside the namespace named HOST instead of on a remote host.
_NETNS_SSH = """#!/bin/sh
# sparsecomm emulate: hydra's -launcher-exec, "ssh" into a network namespace of this machine.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec ip netns exec "$host" sh -c "$*"
"""

# Runs one MPI rank: its output to its log (rank 0's stays on mpiexec's stdout, which is ours),
# and its exit status to a file, since hydra reports only one status for the whole job.
_RANK_SH = """#!/bin/sh
# usage: rank.sh RANK LOGDIR STATEDIR COMMAND...
r=$1; logs=$2; state=$3; shift 3
if [ "$r" -eq 0 ]; then "$@"; else "$@" >"$logs/rank$r.log" 2>&1; fi
s=$?
echo "$s" >"$state/rank$r.tmp" && mv "$state/rank$r.tmp" "$state/rank$r.status"
exit "$s"
"""


def _mpiexec() -> str:
    """MPICH's hydra ``mpiexec``: next to this Python (the ``mpich`` wheel) or on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    exe = str(local) if local.exists() else shutil.which("mpiexec")
    if exe is None:
        raise EmulateError("sparsecomm emulate --mpi needs MPICH's mpiexec (pip install mpich mpi4py)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version:
        # Open MPI's mpirun and others have other options for launchers and interfaces.
        raise EmulateError(f"sparsecomm emulate --mpi needs MPICH's (hydra) mpiexec; {exe} is not")
    return exe


class _MPIRanks:
    """One ``mpiexec`` inside the first namespace, "ssh"-ing its proxies into the others.

    1. mpiexec (hydra) runs inside ``{prefix}0`` with the hosts ``{prefix}0 ..
       {prefix}{P-1}``, one rank each, which the namespaces' hosts files
       resolve to the ranks' addresses; its control port is on ``{prefix}v0``.
    2. Its ssh launcher is ``netns-ssh``: ``ip netns exec HOST sh -c ...``.
    3. The ranks talk over libfabric's TCP provider pinned to their own port
       (``FI_TCP_IFACE``); UCX, the wheel's default, would find the other
       ranks on the same machine and use shared memory, bypassing the shaping.
    4. Each rank runs under ``rank.sh``, which records its exit status.
    """

    launcher = "mpiexec"
    #: Straight to SIGKILL: on SIGTERM hydra tries to signal proxies that are already being
    #: killed and prints a screenful of socket errors that would hide the real message.
    signals = (signal.SIGKILL,)

    def __init__(self, P: int, rate: str, command: list[str], threads: int, env: dict[str, str] | None,
                 logdir: Path, port: int, prefix: str, state: Path) -> None:
        exe = _mpiexec()
        self.P, self.state = P, state
        ssh, rank_sh = state / "netns-ssh", state / "rank.sh"
        for path, text in ((ssh, _NETNS_SSH), (rank_sh, _RANK_SH)):
            path.write_text(text)
            path.chmod(0o755)
        extra = dict(env or {})
        mpi_env = dict(os.environ)
        mpi_env.update(_common_env(P, rate, port, threads),
                       MPICH_CH4_NETMOD="ofi", FI_PROVIDER="tcp",
                       # never shared memory between the "nodes", whatever MPICH thinks of the host names
                       MPIR_CVAR_NOLOCAL="1")
        mpi_env.update(extra)
        hosts = ",".join(f"{prefix}{r}:1" for r in range(P))
        args = [exe, "-launcher", "ssh", "-launcher-exec", str(ssh), "-iface", f"{prefix}v0", "-hosts", hosts]
        for r in range(P):
            per_rank = {"GLOO_SOCKET_IFNAME": f"{prefix}v{r}", "FI_TCP_IFACE": f"{prefix}v{r}"}
            if r > 0:
                args.append(":")
            args += ["-n", "1"]
            for key, value in per_rank.items():
                if key not in extra:  # the caller's env has the last word, as in gloo mode
                    args += ["-env", key, value]
            args += [str(rank_sh), str(r), str(logdir), str(state), *command]
        self.procs = [subprocess.Popen(["ip", "netns", "exec", f"{prefix}0", *args], env=mpi_env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)]

    def codes(self) -> dict[int, int | None]:
        codes: dict[int, int | None] = {}
        for r in range(self.P):
            try:
                codes[r] = int((self.state / f"rank{r}.status").read_text())
            except (OSError, ValueError):
                codes[r] = None
        return codes

    def launcher_exit(self) -> int | None:
        return self.procs[0].poll()

    def finish(self, deadline: float) -> int:
        # Every rank is done; mpiexec still has to collect them.
        try:
            rc = self.procs[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say("every rank finished but mpiexec did not exit; killing it")
            return EXIT_TIMEOUT
        if rc != 0:
            _say(f"every rank succeeded but mpiexec exited with status {_exit_status(rc)}")
        return _exit_status(rc)


def run(P: int, rate: str, command: Sequence[str], timeout: float, threads: int = 1,
        env: dict[str, str] | None = None, *, logs: str | os.PathLike | None = None,
        port: int = 29600, mpi: bool = False, prefix: str = "sc") -> int:
    """Run ``command`` as P ranks of an emulated cluster at ``rate``; return the exit status.

    1. Check the preconditions; if one fails, print why and return 2.
    2. Inside :func:`cluster`, start rank r inside namespace ``{prefix}{r}``:
       with gloo (default) as ``ip netns exec {prefix}{r} command`` in its own
       process group, with ``RANK=r``, ``WORLD_SIZE=P`` and
       ``GLOO_SOCKET_IFNAME={prefix}v{r}``; with ``mpi``, as rank r of one
       ``mpiexec`` (MPICH's hydra, see :class:`_MPIRanks`), pinned to
       ``{prefix}v{r}`` with ``FI_TCP_IFACE``. Both get ``LOCAL_RANK=0``,
       ``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR=10.77.0.1``, ``MASTER_PORT=port``,
       ``OMP_NUM_THREADS=threads``, ``SPARSECOMM_LAUNCHER=emulate`` and
       ``SPARSECOMM_NETWORK`` (:func:`network_label`), then ``env``.
       Rank 0 writes to this process's stdout/stderr; rank r > 0 to
       ``rank{r}.log`` in ``logs`` (default: a temporary folder).
    3. Wait. When a rank exits non-zero, stop the others, name it (and print
       the tail of its log) and return its status. When ``timeout`` seconds
       pass, stop all, name the ranks still running and return 124.
    4. Always stop the ranks and tear the cluster down, also on Ctrl-C or SIGTERM.

    Args:
        P: number of ranks.
        rate: tbf rate of every port (``1gbit``, ``10gbit``, ``100mbit``).
        command: the program and its arguments, run once per rank.
        timeout: seconds before every rank is killed.
        threads: ``OMP_NUM_THREADS`` of each rank (torch takes its thread count from it).
        env: extra variables for every rank, set last (so they can override the defaults).
        logs: folder for the ranks' logs (kept); default a temporary folder,
            removed when every rank succeeded.
        port: ``MASTER_PORT`` (each cluster has its own addresses, so a fixed port is safe).
        mpi: run the ranks under MPICH's mpiexec instead of as separate processes
            (for MPI programs, e.g. mpi4py; ``RANK``/``WORLD_SIZE`` are then not set,
            so torchrun-style code does not mistake the job for a torchrun one).
        prefix: namespace and interface name prefix.

    Returns:
        0 when every rank succeeded; the failing rank's status (128 + N for
        signal N); 124 on timeout; 2 when a precondition failed.
    """
    if not command:
        _say("no command given (usage: sparsecomm emulate --ranks P --rate RATE -- COMMAND...)")
        return EXIT_PRECONDITION
    try:
        preflight(P, rate)
        if mpi:
            _mpiexec()
    except EmulateError as e:
        print(e, file=sys.stderr, flush=True)
        return e.exit_code
    own_logs = logs is None
    logdir = Path(tempfile.mkdtemp(prefix="sparsecomm-emulate-") if own_logs else logs)
    logdir.mkdir(parents=True, exist_ok=True)
    status = 1
    try:
        with cluster(P, rate, prefix), tempfile.TemporaryDirectory(prefix="sparsecomm-emulate-state-") as state:
            status = _launch_and_wait(P, rate, list(command), timeout, threads, env, logdir, port, prefix,
                                      Path(state) if mpi else None)
    except EmulateError as e:
        print(e, file=sys.stderr, flush=True)
        status = e.exit_code
    finally:
        if own_logs and status == 0:
            shutil.rmtree(logdir, ignore_errors=True)
    if status != 0 and any(logdir.glob("rank*.log")):
        _say(f"logs of ranks 1..{P - 1} are in {logdir}")
    return status


def _launch_and_wait(P: int, rate: str, command: list[str], timeout: float, threads: int,
                     env: dict[str, str] | None, logdir: Path, port: int, prefix: str,
                     mpi_state: Path | None) -> int:
    """Start the ranks inside their namespaces and wait for them (steps 2-4 of :func:`run`)."""
    files: list[IO[bytes]] = []
    namespaces = [f"{prefix}{r}" for r in range(P)]
    ranks: _GlooRanks | _MPIRanks | None = None
    try:
        if mpi_state is None:
            ranks = _GlooRanks(P, rate, command, threads, env, logdir, port, prefix, files)
        else:
            ranks = _MPIRanks(P, rate, command, threads, env, logdir, port, prefix, mpi_state)
        deadline = time.monotonic() + timeout
        while True:
            codes = ranks.codes()
            failed = sorted(r for r, c in codes.items() if c not in (None, 0))
            running = sorted(r for r, c in codes.items() if c is None)
            if failed:
                r = failed[0]
                _say(f"rank {r} failed with exit status {_exit_status(codes[r] or 0)}"
                     + (f"; stopping ranks {', '.join(map(str, running))}" if running else ""))
                _stop(ranks.procs, namespaces, signals=ranks.signals)
                if r > 0:
                    for f in files:
                        f.flush()
                    log = logdir / f"rank{r}.log"
                    tail = _tail(log)
                    if tail:
                        print(f"--- last lines of rank {r}'s log ({log}) ---\n{tail}\n---",
                              file=sys.stderr, flush=True)
                return _exit_status(codes[r] or 0)
            if not running:
                return ranks.finish(deadline)
            gone = ranks.launcher_exit()
            if gone is not None:
                _say(f"{ranks.launcher} exited with status {_exit_status(gone)} while ranks "
                     f"{', '.join(map(str, running))} had not finished")
                _stop(ranks.procs, namespaces, signals=ranks.signals)
                return _exit_status(gone) or 1
            if time.monotonic() > deadline:
                _say(f"timed out after {timeout:g} s; killing ranks still running: "
                     f"{', '.join(map(str, running))}")
                _stop(ranks.procs, namespaces, signals=ranks.signals)
                return EXIT_TIMEOUT
            time.sleep(0.05)
    finally:
        # Also on Ctrl-C/SIGTERM: the ranks must be gone before their namespaces are deleted,
        # or the namespaces (and their veths) outlive the names.
        _stop(ranks.procs if ranks is not None else [], namespaces,
              signals=ranks.signals if ranks is not None else _GlooRanks.signals)
        for f in files:
            f.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``sparsecomm emulate`` to ``parser`` (the command is the REMAINDER after ``--``)."""
    parser.add_argument("--ranks", "-n", type=int_in(1, MAX_RANKS), required=True, metavar="P",
                        help=f"number of ranks, 1 to {MAX_RANKS} (one network namespace each)")
    parser.add_argument("--rate", type=checked_by(tc_rate, "rate"), default="1gbit",
                        help="tbf rate of every port, both directions, in tc syntax (default: 1gbit)")
    parser.add_argument("--timeout", type=positive_float, default=3600.0, metavar="S",
                        help="kill every rank after S seconds (default: 3600)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="T",
                        help="OMP_NUM_THREADS of each rank (default: 1)")
    parser.add_argument("--port", type=int_in(1, 65535), default=29600, help="MASTER_PORT (default: 29600)")
    parser.add_argument("--mpi", action="store_true",
                        help="run the ranks under MPICH's mpiexec (MPI over TCP) instead of as "
                             "torch.distributed ranks (RANK, WORLD_SIZE, MASTER_ADDR)")
    parser.add_argument("--logs", metavar="DIR", default=None,
                        help="folder for the logs of ranks 1..P-1 (default: a temporary folder)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the program run on every rank")


def main(args: argparse.Namespace) -> int:
    """Run ``sparsecomm emulate`` with parsed ``args``; return the exit status (see :func:`run`)."""
    command = list(args.command)
    if command and command[0] == "--":  # argparse keeps the separator in a REMAINDER
        command = command[1:]
    try:
        return run(args.ranks, args.rate, command, args.timeout, threads=args.threads,
                   logs=args.logs, port=args.port, mpi=args.mpi)
    except KeyboardInterrupt:
        # run() has stopped the ranks and removed the cluster on the way out; no traceback.
        _say("interrupted; ranks stopped and the emulated cluster removed")
        return 130
