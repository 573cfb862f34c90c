"""Time revisions side by side: the same Ok-Topk calls on MPI and gloo, alternated in one sitting.

Counts (messages, bytes, reads) do not show a change that makes the bytes slower to pack or
decode; only a clock does, and a clock on a shared machine drifts. So each revision is checked
out apart (``git worktree``, nothing installed: the run puts the checkout first on
``PYTHONPATH``) and every (revision, engine, P) run is repeated in rounds, the revisions
alternating within each round. A run starts P ranks (``mpiexec`` for MPI, ``torchrun`` for
gloo), makes ``--calls`` calls of ``sparsecomm.allreduce`` on a fresh Gaussian gradient of
``--elements`` entries each (Ok-Topk, ``--density``, error feedback: the plain call a user makes with a
state) and keeps the last ``--keep``: per call, each phase's seconds (``state.last.phases``) and
the whole call's, the slowest rank's, and what the call spent outside every phase (a phase's
bounds may move between revisions: compare a phase together with this row). A run's figure is the median of its kept calls; the table
gives, per phase, the median over rounds for each revision and the ratio to the first revision.
Only APIs that exist since ``8a3da7c`` are used (``state.last.phases[name].seconds``).

Run it on any change to ``sparsecomm/comm/``, ``sparsecomm/algorithms/exchange.py``,
``kernels/message.py`` or the pipeline, alone on the machine, and keep its output with the
change's results::

    python benchmarks/compare_revisions.py 8a3da7c HEAD                  # MPI and gloo, P = 2 and 4
    python benchmarks/compare_revisions.py main WORK --engines mpi --ranks 2 --rounds 7

``WORK`` names the working tree as it is (uncommitted changes included). Ranks run one torch
thread each. Exit status 2 with one line for a bad argument (an unknown revision, a missing
launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = "WORK"
#: The row of the time a call spent outside every phase.
OUTSIDE = "(outside phases)"


def _worker(n: int, density: float, calls: int, keep: int, engine: str) -> None:
    """One rank of a run (this file, started by a launcher): the calls, then rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    import sparsecomm

    torch.set_num_threads(1)
    if engine == "gloo":
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def gather(x):
            out = [None] * size
            dist.all_gather_object(out, x)
            return out

        def barrier():
            dist.barrier()
    else:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        gather, barrier = world.allgather, world.Barrier
    st = sparsecomm.OkTopkState(density)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for i in range(calls):
        grad = torch.randn(n, generator=gen)
        barrier()
        t0 = time.perf_counter()
        sparsecomm.allreduce(grad, state=st)
        wall = time.perf_counter() - t0
        if i >= calls - keep:
            row = {name: p.seconds for name, p in st.last.phases.items()}
            # What no phase holds: the input check where it is a collective of its own (before
            # it was carried by the first exchange), the result's settling, Python around them.
            row[OUTSIDE] = wall - sum(row.values())
            row["call"] = wall
            rows.append(row)
    every = gather(rows)
    if rank == 0:
        # The slowest rank's figure per call, then the median over the kept calls.
        names = sorted({k for r in every for row in r for k in row})
        med = {k: statistics.median(max(r[c].get(k, 0.0) for r in every) for c in range(keep)) for k in names}
        print("RESULT " + json.dumps({"phases": med, "P": size, "package": sparsecomm.__file__}), flush=True)
    if engine == "gloo":
        dist.destroy_process_group()
        # Revisions before the communicator cache was dropped at exit leave a process group
        # for finalisation, where gloo's teardown aborts now and then (benchmarks/results/
        # 2026-11-27-cpu-vm-teardown-abort): this rank's work is done and reported.
        sys.stdout.flush()
        os._exit(0)


def _refuse(why: str) -> None:
    """One line and exit status 2, as the project's commands answer a bad argument."""
    print(f"compare_revisions: {why}", file=sys.stderr)
    raise SystemExit(2)


def _checkout(rev: str, into: Path) -> Path:
    """A checkout of ``rev`` under ``into`` (``WORK``: the working tree itself)."""
    if rev == WORK:
        return ROOT
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", rev + "^{commit}"],
                         capture_output=True, text=True).stdout.strip()
    if not sha:
        _refuse(f"{rev}: not a revision of {ROOT}")
    path = into / sha[:10]
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), sha],
                       check=True, capture_output=True)
    return path


def _launch(engine: str, P: int) -> list[str]:
    if engine == "mpi":
        exe = shutil.which("mpiexec")
        if exe is None:
            _refuse("mpiexec not found (pip install mpi4py mpich)")
        return [exe, "-n", str(P), sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(P)]


def _run(tree: Path, engine: str, P: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [*_launch(engine, P), str(Path(__file__).resolve()), "--worker", engine, "--elements", str(args.elements),
           "--density", str(args.density), "--calls", str(args.calls), "--keep", str(args.keep)]
    # (cwd: the checkout, so that nothing of another revision shadows its package)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{engine} P={P} in {tree}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    got = json.loads(line[len("RESULT "):])
    if not Path(got["package"]).resolve().is_relative_to(tree.resolve()):  # an installed copy won
        raise RuntimeError(f"{tree}: the ranks imported {got['package']}, not the checkout's sparsecomm")
    return got["phases"]


def _table(revs: list[str], runs: dict) -> str:
    lines = []
    for (engine, P), by_rev in runs.items():
        names = sorted({k for rounds in by_rev.values() for r in rounds for k in r}, key=lambda k: (k == "call", k == OUTSIDE, k))
        head = " | ".join(f"{r} ms" for r in revs) + "".join(f" | {r} / {revs[0]}" for r in revs[1:])
        lines += [f"\n{engine}, P = {P} (median over {len(by_rev[revs[0]])} rounds of each run's median call)\n",
                  f"| phase | {head} |", "|---" * (1 + 2 * len(revs) - 1) + "|"]
        for k in names:
            med = [statistics.median(r.get(k, 0.0) for r in by_rev[rev]) * 1e3 for rev in revs]
            ratios = "".join(f" | {m / med[0]:.2f}" if med[0] else " | -" for m in med[1:])
            lines.append(f"| {k} | " + " | ".join(f"{m:.2f}" for m in med) + ratios + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", help=f"git revisions (or {WORK}); the first is the baseline")
    parser.add_argument("--engines", nargs="+", default=["mpi", "gloo"], choices=["mpi", "gloo"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="alternations (at least 5 for a claim)")
    parser.add_argument("--elements", type=int, default=4_000_000,
                        help="gradient entries (not --n: torchrun would take it for one of its own options)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--keep", type=int, default=20, help="the last calls kept (the first warm the threshold)")
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument("--worker", choices=["mpi", "gloo"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.elements, args.density, args.calls, args.keep, args.worker)
        return 0
    if len(args.revisions) < 1:
        parser.error("name at least one revision")
    if not 0 < args.keep <= args.calls or args.rounds < 1 or min(args.ranks) < 2:
        parser.error("need 0 < --keep <= --calls, --rounds >= 1 and ranks >= 2")
    for engine in args.engines:
        _launch(engine, 2)
    with tempfile.TemporaryDirectory(prefix="compare_revisions-") as tmp:
        trees = {rev: _checkout(rev, Path(tmp)) for rev in args.revisions}
        try:
            runs: dict = {(e, P): {rev: [] for rev in args.revisions} for e in args.engines for P in args.ranks}
            for i in range(args.rounds):
                for (engine, P), by_rev in runs.items():
                    order = args.revisions if i % 2 == 0 else args.revisions[::-1]  # neither always first
                    for rev in order:
                        by_rev[rev].append(_run(trees[rev], engine, P, args))
                print(f"# round {i + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    print(f"# compare_revisions: Ok-Topk, n = {args.elements:,}, density {args.density}, {args.calls} calls "
          f"(last {args.keep} kept), one torch thread a rank; revisions: "
          + ", ".join(f"{r} ({trees[r].name if trees[r] != ROOT else 'working tree'})" for r in args.revisions))
    print(_table(args.revisions, runs))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{e} P={P}": v for (e, P), v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
