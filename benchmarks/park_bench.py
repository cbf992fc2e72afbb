"""A parked optimizer state's copies on one GPU ([parking]): how fast it goes to the host and back, against the link.

    python -m benchmarks.park_bench --size 8b --world 2 --fractions 0.5 0.8 1.0 --out results/optim/<name>
    python -m benchmarks.park_bench --size tiny --iters 1 --warmup 0   # CPU smoke run

Issue 41 item 4: on 2 H200s held to an 80 GB card's budget, parking 80% of AdamW's state cost about 0.75 s a step
(``results/e2e/n2_8b_longtail_parkfit_201ef99``), about 29 GB/s for the bytes that moved. This takes the copies apart
on one GPU, at rank 0's shard sizes of ``--world`` ranks (``optim_bench.shard_shapes``): AdamW (fused on CUDA) over
one fp32 tensor per parameter, its state parked by ``ParkedOptimizerState(fraction=f)``, then per step:

* ``back``: ``prefetch_parked`` until its copies are done (host to device, the share parked);
* ``step``: the optimizer step on the state brought back (its pre-hook waits for nothing more);
* ``park``: from the step's end until the copies out are done (device to host, on the side stream).

Each is wall-clock time between device synchronisations (medians of ``--iters`` after ``--warmup``), so they do not
overlap here as they would under a meeting or a forward: the sum is the worst case, each part what it costs alone.
Next to them, one pinned buffer of the parked bytes copied each way by itself: the link's rate on this host.

In training the copies are queued behind device work (the copies back behind the last backward, the copies out behind
the step), and the host should return at once. ``--busy-ms`` queues that much work on the current stream first and
times how long the host takes to return from ``prefetch_parked`` and from the step (its post-hook queues the copies
out): about the busy time, or more, means the host waits for the device while it queues copies.

Last, a one-element read back to the host right after the step (its post-hook has queued the copies out), with the
copies queued all at once and a chunk at a time by a helper thread (``trickle``, [park-trickle]): how long a small
device-to-host read, a meeting's or a loss's, waits behind them.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import harness, provenance, timing
from benchmarks.optim_bench import shard_shapes
from odcfsdp.optim import ParkedOptimizerState, prefetch_parked


def _ms(fn, device: torch.device, stream_only: bool = False) -> float:
    """Wall-clock milliseconds from an idle device until ``fn``'s work is done: the whole device's (every stream:
    side-stream copies included), or with ``stream_only`` the current stream's alone."""
    if device.type != "cuda":
        return timing.elapsed_ms(fn, cuda=False)
    torch.cuda.synchronize(device)
    wait = torch.cuda.current_stream(device).synchronize if stream_only else torch.cuda.synchronize
    return timing.elapsed_ms(lambda: (fn(), wait()), cuda=False)


class BusyWork:
    """About ``ms`` milliseconds of matrix products queued on the current stream (calibrated once; none on CPU)."""

    def __init__(self, device: torch.device):
        self.device, self.per_ms = device, 0.0
        if device.type == "cuda":
            self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            self.out = torch.empty_like(self.a)
            self.queue(20)
            torch.cuda.synchronize(device)
            self.per_ms = 50 / _ms(lambda: self.queue(50), device)

    def queue(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.a, out=self.out)

    def __call__(self, ms: float) -> None:
        self.queue(round(ms * self.per_ms))


def link_rates(nbytes: int, device: torch.device, iters: int) -> dict:
    """GB/s of one pinned host buffer of ``nbytes`` copied to ``device`` and back (each way alone)."""
    n = max(1, nbytes // 4)
    host = torch.empty(n, dtype=torch.float32, pin_memory=device.type == "cuda")
    dev = torch.empty(n, dtype=torch.float32, device=device)
    dev.copy_(host), host.copy_(dev)  # first touches (page faults, lazy init) are not the link's
    to_dev = statistics.median(_ms(lambda: dev.copy_(host, non_blocking=True), device) for _ in range(iters))
    to_host = statistics.median(_ms(lambda: host.copy_(dev, non_blocking=True), device) for _ in range(iters))
    return {"h2d_gb_s": 4 * n / to_dev / 1e6, "d2h_gb_s": 4 * n / to_host / 1e6}


def run_fraction(shapes, fraction: float, args, device: torch.device, busy: BusyWork) -> dict:
    """The three parts of a parked step (``fraction`` 0: the step alone, nothing parked), and the host's time to
    queue the copies behind ``--busy-ms`` of device work."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for _, shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device).mul_(1e-3)
    opt = torch.optim.AdamW(params, lr=3e-4, fused=device.type == "cuda")
    opt.step()  # the state exists from here
    parking = ParkedOptimizerState(opt, fraction=fraction, trickle=False) if fraction > 0 else None
    opt.step()  # parked after it
    parts: dict[str, list[float]] = {"back": [], "step": [], "park": [], "back_issue_busy": [],
                                     "step_issue_busy": [], "read_after_step": [], "read_after_step_trickle": []}
    probe = torch.zeros(1, device=device)
    for i in range(args.warmup + args.iters):
        back = _ms(lambda: prefetch_parked(opt), device)
        # the pre-hook waits for the copies back, the post-hook queues the copies out (the side stream: not waited)
        step = _ms(opt.step, device, stream_only=True)
        # the side stream's copies out, still running after the step: waited for from here, with no sync before
        park = timing.elapsed_ms(lambda: device.type == "cuda" and torch.cuda.synchronize(device), cuda=False)
        busy(args.busy_ms)  # the same calls queued behind device work: the host's time until each returns
        back_issue = timing.elapsed_ms(lambda: prefetch_parked(opt), cuda=False)
        busy(args.busy_ms)
        step_issue = timing.elapsed_ms(opt.step, cuda=False)
        _ms(lambda: None, device)  # everything done before the next iteration
        reads = {}
        for trickle in (False, True):  # a small read right after the step queued its copies out
            if parking is not None:
                parking.trickle = trickle
            _ms(lambda: prefetch_parked(opt), device)
            opt.step()
            reads[trickle] = timing.elapsed_ms(probe.cpu, cuda=False)
            _ms(parking.wait_copies_out if parking is not None else (lambda: None), device)
        if parking is not None:
            parking.trickle = False  # the parts above queue the copies out at once ([park-trickle] off)
        if i >= args.warmup:
            for key, value in (("back", back), ("step", step), ("park", park), ("back_issue_busy", back_issue),
                               ("step_issue_busy", step_issue), ("read_after_step", reads[False]),
                               ("read_after_step_trickle", reads[True])):
                parts[key].append(value)
    moved = parking.parked_bytes if parking is not None else 0
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    row = {"fraction": fraction, "state_gib": state / 2**30, "parked_gib": moved / 2**30}
    for key, values in parts.items():
        ms = statistics.median(values)
        row[f"{key}_ms"] = ms
        if key in ("back", "park"):
            row[f"{key}_gb_s"] = moved / ms / 1e6 if moved and ms > 0 else None
    if parking is not None:
        parking.close()
    return row


def report(rows: list[dict], meta: dict) -> str:
    """The markdown table of one run."""
    def gb(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"# Parked optimizer state: copies on one device ({meta['device']})", "",
             f"- commit {meta['commit']}, {meta['date']}; `{meta['command']}`",
             f"- rank 0's shards of {meta['world']} ranks, model {meta['size']}; the link alone: host to device "
             f"{meta['h2d_gb_s']:.1f} GB/s, device to host {meta['d2h_gb_s']:.1f} GB/s (one pinned buffer)",
             f"- behind {meta['busy_ms']:.0f} ms of device work: the host's time until prefetch_parked returns "
             "(back issue) and until the step returns (step issue: its post-hook queues the copies out)",
             "- read after the step: a one-element copy to the host right after the step, behind the copies out queued "
             "at once / a chunk at a time (trickle)", "",
             "| fraction | state GiB | parked GiB | back ms (GB/s) | step ms | park ms (GB/s) | back issue ms, busy | "
             "step issue ms, busy | read after the step ms | read after the step ms, trickle |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fraction']:.2f} | {r['state_gib']:.2f} | {r['parked_gib']:.2f} | "
                     f"{r['back_ms']:.1f} ({gb(r['back_gb_s'])}) | {r['step_ms']:.1f} | "
                     f"{r['park_ms']:.1f} ({gb(r['park_gb_s'])}) | {r['back_issue_busy_ms']:.1f} | "
                     f"{r['step_issue_busy_ms']:.1f} | {r['read_after_step_ms']:.2f} | "
                     f"{r['read_after_step_trickle_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="8b")
    p.add_argument("--world", type=int, default=2, help="ranks the model is sharded over (rank 0's shards are used)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.8, 1.0],
                   help="shares of the state parked, each in (0, 1]; the step alone (0) is always measured first")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--busy-ms", type=float, default=200.0,
                   help="device work queued before the copies are issued, for the host's issue times")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=provenance.default_commit())
    args = p.parse_args(argv)
    if any(not 0.0 < f <= 1.0 for f in args.fractions):
        p.error(f"--fractions {args.fractions}: each is a share in (0, 1]")
    return args


def main(argv=None) -> None:
    """Measure every fraction on this process's device; write the report (and files under ``--out``)."""
    args = parse(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = shard_shapes(args.size, args.vocab, args.world)
    state = 8 * sum(torch.Size(s).numel() for _, s in shapes)
    busy = BusyWork(device)
    meta = harness.meta(args.commit, harness.command(__name__, argv), harness.device_name(device), world=args.world,
                        size=args.size, busy_ms=args.busy_ms if device.type == "cuda" else 0.0,
                        **link_rates(min(state, 8 << 30), device, max(1, args.iters)))
    rows = []
    for fraction in [0.0, *args.fractions]:
        rows.append(run_fraction(shapes, fraction, args, device, busy))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last fraction's tensors are gone with its call
        print(report(rows, meta), flush=True)
        if args.out:  # after each fraction: a call cut by its limit keeps what it measured
            harness.write_result(args.out, "park_bench", meta, rows, report(rows, meta))


if __name__ == "__main__":
    main()
