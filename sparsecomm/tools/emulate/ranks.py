"""Ranks of a command inside the emulated cluster: gloo processes, or one MPICH job."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Sequence

from .netns import (EXIT_PRECONDITION, EXIT_TIMEOUT, SUBNET, EmulateError, cluster, network_label, preflight)

__all__ = ["run", "say"]


def _common_env(P: int, rate: str, port: int, threads: int, G: int = 1) -> dict[str, str]:
    """Variables every rank gets in both modes (on top of the caller's environment); G ranks a node."""
    return dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(G), MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads),
                SPARSECOMM_LAUNCHER="emulate", SPARSECOMM_NETWORK=network_label(P, rate, G))


def _rank_env(r: int, P: int, rate: str, port: int, threads: int, prefix: str,
              extra: dict[str, str] | None, G: int = 1) -> dict[str, str]:
    """The environment of gloo rank r: the caller's, the launcher's variables, then ``extra``."""
    env = dict(os.environ)
    env.update(_common_env(P, rate, port, threads, G), RANK=str(r), WORLD_SIZE=str(P), LOCAL_RANK=str(r % G),
               # gloo would otherwise pick the interface of the host name's address.
               GLOO_SOCKET_IFNAME=f"{prefix}v{r // G}")
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


def say(message: str) -> None:
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
                 logdir: Path, port: int, prefix: str, files: list[IO[bytes]], G: int = 1) -> None:
        self.procs: list[subprocess.Popen] = []
        for r in range(P):
            out: IO[bytes] | None = None
            if r > 0:
                out = open(logdir / f"rank{r}.log", "wb")
                files.append(out)
            # ip netns exec execs the command, so the Popen pid is the rank itself,
            # and start_new_session makes it the leader of a group we can kill whole.
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", f"{prefix}{r // G}", *command],
                env=_rank_env(r, P, rate, port, threads, prefix, env, G),
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
                 logdir: Path, port: int, prefix: str, state: Path, G: int = 1) -> None:
        exe = _mpiexec()
        self.P, self.state = P, state
        ssh, rank_sh = state / "netns-ssh", state / "rank.sh"
        for path, text in ((ssh, _NETNS_SSH), (rank_sh, _RANK_SH)):
            path.write_text(text)
            path.chmod(0o755)
        extra = dict(env or {})
        mpi_env = dict(os.environ)
        mpi_env.update(_common_env(P, rate, port, threads, G),
                       MPICH_CH4_NETMOD="ofi", FI_PROVIDER="tcp",
                       # never shared memory between the "nodes", whatever MPICH thinks of the host names
                       MPIR_CVAR_NOLOCAL="1")
        mpi_env.update(extra)
        hosts = ",".join(f"{prefix}{g}:{G}" for g in range(P // G))
        args = [exe, "-launcher", "ssh", "-launcher-exec", str(ssh), "-iface", f"{prefix}v0", "-hosts", hosts]
        for r in range(P):
            per_rank = {"GLOO_SOCKET_IFNAME": f"{prefix}v{r // G}", "FI_TCP_IFACE": f"{prefix}v{r // G}",
                        "LOCAL_RANK": str(r % G)}
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
            say("every rank finished but mpiexec did not exit; killing it")
            return EXIT_TIMEOUT
        if rc != 0:
            say(f"every rank succeeded but mpiexec exited with status {_exit_status(rc)}")
        return _exit_status(rc)


def run(P: int, rate: str, command: Sequence[str], timeout: float, threads: int = 1,
        env: dict[str, str] | None = None, *, logs: str | os.PathLike | None = None,
        port: int = 29600, mpi: bool = False, prefix: str = "sc", ranks_per_node: int = 1) -> int:
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
        ranks_per_node: G, ranks sharing a namespace (a node): ranks g G .. g G + G - 1 run
            in namespace ``{prefix}{g}``, behind its one shaped port, and reach each other
            over its loopback (unshaped: the node's fabric, as fast as the cores allow);
            ``LOCAL_RANK`` is r mod G and ``LOCAL_WORLD_SIZE`` G. P must be a multiple of G.

    Returns:
        0 when every rank succeeded; the failing rank's status (128 + N for
        signal N); 124 on timeout; 2 when a precondition failed.
    """
    if not command:
        say("no command given (usage: sparsecomm emulate --ranks P --rate RATE -- COMMAND...)")
        return EXIT_PRECONDITION
    try:
        if ranks_per_node < 1 or P % ranks_per_node:
            raise EmulateError(f"sparsecomm emulate: --ranks {P} is not a multiple of --ranks-per-node "
                               f"{ranks_per_node}")
        preflight(P // ranks_per_node, rate)
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
        with cluster(P // ranks_per_node, rate, prefix), \
                tempfile.TemporaryDirectory(prefix="sparsecomm-emulate-state-") as state:
            status = _launch_and_wait(P, rate, list(command), timeout, threads, env, logdir, port, prefix,
                                      Path(state) if mpi else None, ranks_per_node)
    except EmulateError as e:
        print(e, file=sys.stderr, flush=True)
        status = e.exit_code
    finally:
        if own_logs and status == 0:
            shutil.rmtree(logdir, ignore_errors=True)
    if status != 0 and any(logdir.glob("rank*.log")):
        say(f"logs of ranks 1..{P - 1} are in {logdir}")
    return status


def _launch_and_wait(P: int, rate: str, command: list[str], timeout: float, threads: int,
                     env: dict[str, str] | None, logdir: Path, port: int, prefix: str,
                     mpi_state: Path | None, G: int = 1) -> int:
    """Start the ranks inside their namespaces and wait for them (steps 2-4 of :func:`run`)."""
    files: list[IO[bytes]] = []
    namespaces = [f"{prefix}{g}" for g in range(P // G)]
    ranks: _GlooRanks | _MPIRanks | None = None
    try:
        if mpi_state is None:
            ranks = _GlooRanks(P, rate, command, threads, env, logdir, port, prefix, files, G)
        else:
            ranks = _MPIRanks(P, rate, command, threads, env, logdir, port, prefix, mpi_state, G)
        deadline = time.monotonic() + timeout
        while True:
            codes = ranks.codes()
            failed = sorted(r for r, c in codes.items() if c not in (None, 0))
            running = sorted(r for r, c in codes.items() if c is None)
            if failed:
                r = failed[0]
                say(f"rank {r} failed with exit status {_exit_status(codes[r] or 0)}"
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
                say(f"{ranks.launcher} exited with status {_exit_status(gone)} while ranks "
                     f"{', '.join(map(str, running))} had not finished")
                _stop(ranks.procs, namespaces, signals=ranks.signals)
                return _exit_status(gone) or 1
            if time.monotonic() > deadline:
                say(f"timed out after {timeout:g} s; killing ranks still running: "
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
