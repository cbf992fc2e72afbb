"""How long the watchdog's arrival guard ([watchdog] 1) holds ranks after the last one arrives at a meeting.

    python -m benchmarks.meeting_bench --cpu-ranks 4 --late-ms 0 2 5 15 30 --meetings 40 --out results/meetings/<name>

Every minibatch the ranks meet twice (the sync and the finish, [lifecycle]), and each meeting starts with the
arrival guard: a rank registers in the store and is let go once every rank has. With uneven work (odc's point:
ranks run different micro-batches, and even balanced ranks drift by milliseconds, not being in lockstep through
collectives as FSDP2's are) ranks arrive at the sync milliseconds apart; the early ones wait, and whatever they
take to notice the last arrival is added to the step of every rank.

Per meeting: the ranks line up (a gloo barrier), rank N-1 sleeps ``--late-ms`` (the others none), then every rank
calls ``Watchdog.arrive``; the *release lag* is the last rank to leave ``arrive`` minus the last to enter it
(wall clock, one host). Medians and 90th percentiles over ``--meetings`` per lateness. Only the guard is timed:
the meeting's collective after it is the same whatever the guard does. Runs on CPU ranks (the guard is host work
through the launcher's store, whatever the device).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import harness


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worker(args, _device) -> None:
    import torch.distributed as dist

    from odcfsdp.sharding.placement.collectives import RankGroup
    from odcfsdp.sharding.placement.watchdog import Watchdog

    group = RankGroup()
    watchdog = Watchdog(group, timeout_s=120.0)
    timings = []
    for late_ms in args.late_ms:
        for i in range(args.warmup + args.meetings):
            dist.barrier()
            if group.rank == group.world_size - 1:
                time.sleep(late_ms / 1e3)
            entered = time.time()
            watchdog.arrive(f"meeting {i}")
            left = time.time()
            if i >= args.warmup:
                timings.append((late_ms, entered, left))
    watchdog.close()
    everyone = group.all_gather_object(timings)
    if group.rank:
        return
    rows = []
    for late_ms in args.late_ms:
        per_rank = [[t for t in ranks if t[0] == late_ms] for ranks in everyone]
        lags = [1e3 * (max(r[m][2] for r in per_rank) - max(r[m][1] for r in per_rank))
                for m in range(args.meetings)]
        # a barrier's contract: nobody leaves before the last rank entered (0 here, or the guard is broken)
        early = sum(min(r[m][2] for r in per_rank) < max(r[m][1] for r in per_rank) for m in range(args.meetings))
        rows.append({"late_ms": late_ms, "meetings": args.meetings, "early_leaves": early,
                     "release_lag_ms_median": statistics.median(lags),
                     "release_lag_ms_p90": _percentile(lags, 0.9), "release_lag_ms_max": max(lags)})
    meta = harness.meta(args.commit, args.command, harness.device_name("cpu", group.world_size),
                        ranks=group.world_size, warmup=args.warmup)
    lines = [f"# Arrival guard: release lag after the last rank arrives ({meta['device']}, {meta['date']}, "
             f"commit {meta['commit']})", "", f"- command: `{meta['command']}`", "",
             "| rank N-1 late by (ms) | release lag median (ms) | p90 (ms) | max (ms) | left before the last came |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['late_ms']:g} | {r['release_lag_ms_median']:.3f} | {r['release_lag_ms_p90']:.3f} | "
              f"{r['release_lag_ms_max']:.3f} | {r['early_leaves']} |" for r in rows]
    harness.write_result(args.out, "meeting_bench", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common(p, cpu_ranks=True)
    p.add_argument("--late-ms", type=float, nargs="+", default=[0, 2, 5, 15, 30],
                   help="how late rank N-1 arrives, per series")
    p.add_argument("--meetings", type=int, default=40, help="measured meetings per lateness")
    p.add_argument("--warmup", type=int, default=3, help="meetings not measured, per lateness")
    args = p.parse_args(argv)
    args.command = harness.command(__name__, argv)  # in main: a spawned rank's __name__ is __mp_main__
    harness.run_benchmark_ranks(worker, args, args.cpu_ranks or 4, timeout=600.0)


if __name__ == "__main__":
    main()
