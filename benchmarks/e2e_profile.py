"""The e2e benchmark's profiled step (``--profile``): the profiler, the step's kernel time by kind, the device's idle
time by the host phase it fell in, the host's time per sharding phase and its waits, and their markdown sections."""

from __future__ import annotations

import re

import torch


def step_profiler():
    """A torch profiler for one extra step of the methods named by ``--profile`` (kernel time by kind)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if torch.cuda.is_available()
                   else [ProfilerActivity.CPU])


KERNEL_KINDS = (  # (kind, substrings of kernel names), first match wins
    ("odc gather", ("gather_rows", "gather_get")), ("odc scatter-accumulate", ("scatter_accumulate",)),
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")), ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("memcpy / memset", ("Memcpy", "Memset")),
)


def kernel_summary(prof, top: int = 12) -> dict:
    """Device time of one profiled step by kind of kernel, the time any kernel ran, and the top kernels (this rank)."""
    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # "nccl:..." entries are annotations spanning NCCL's kernels, which are listed themselves.
    events = [e for e in prof.key_averages()
              if str(e.device_type).endswith("CUDA") and device_us(e) > 0 and not e.key.startswith("nccl:")]
    by_kind: dict[str, float] = {}
    for e in events:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in e.key for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + device_us(e) / 1e3
    events.sort(key=lambda e: -device_us(e))
    # Where the host's time goes: operators (and launch calls) by their own CPU time, and how many
    # kernels the step launched (each costs host time, however small the kernel).
    host = sorted((e for e in prof.key_averages() if not str(e.device_type).endswith("CUDA")),
                  key=lambda e: -e.self_cpu_time_total)
    spans = device_spans(prof.events())  # once: the busy time and the idle by phase both read them
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    return {"device_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "busy_ms": _union_us(spans) / 1e3, "idle_ms_by_phase": idle_ms_by_phase(prof, spans),
            "kernel_launches": launches,
            "host_ms_by_phase": host_by_phase(prof),
            "top_kernels": [{"name": e.key[:120], "ms": device_us(e) / 1e3, "calls": e.count} for e in events[:top]],
            "top_host_ops": [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                             for e in host[:2 * top]]}


#: the profiler ranges each framework opens per hook site: odc's [lifecycle] steps (``phase_range``) and FSDP2's
#: ``FSDP::pre_forward``, ``FSDP::post_backward_reduce`` and the like
PHASE_PREFIXES = ("odc::", "FSDP::")


def host_by_phase(prof) -> dict:
    """Host time per sharding phase of one profiled step: for each ``odc::`` / ``FSDP::`` range, its CPU time with
    what it called (ms), how many times it opened, and ms per opening. FSDP2 names its ranges per module
    (``FSDP::pre_forward (layers.0)``); they are folded into one phase. A phase opened inside another (a flush inside a
    push) is in both: compare phase by phase, never their sum."""
    folded: dict[str, list[float]] = {}
    for e in prof.key_averages():
        # a range that launched kernels is also listed on the device's track (the GPU's annotation): host only here
        if e.key.startswith(PHASE_PREFIXES) and e.count and not str(e.device_type).endswith("CUDA"):
            ms_calls = folded.setdefault(re.split(r" \(| \[| for ", e.key)[0], [0.0, 0])
            ms_calls[0] += e.cpu_time_total / 1e3
            ms_calls[1] += e.count
    return {k: {"ms": ms, "calls": n, "ms_per_call": ms / n}
            for k, (ms, n) in sorted(folded.items(), key=lambda kv: -kv[1][0])}


def device_spans(events) -> list[tuple[float, float]]:
    """The (start, end) of every kernel, memcpy and memset among a profile's ``events`` on this rank's device (us),
    sorted: not the ranges' annotations on the device's track (``odc::sync``, ``nccl:...``), which span the idle
    between their kernels too."""
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start
                  and not e.name.startswith("nccl:") and not getattr(e, "is_user_annotation", False))


def _union_us(spans) -> float:
    """The length of the union of ``(start, end)`` intervals: the time any kernel ran, for the device's spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def idle_gaps(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals between the first span's start and the last one's end in which no span ran (sorted spans)."""
    gaps, end = [], float("inf")
    for a, b in spans:
        if a > end:
            gaps.append((end, a))
        end = b if end == float("inf") else max(end, b)
    return gaps


def idle_by_phase(gaps: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> dict[str, float]:
    """How much of the device's idle time (``gaps``, us) fell inside each host phase's ranges (``phases``: name,
    start, end, us on the profiler's one clock), in ms, and ``outside the phases`` for the rest. A phase inside
    another shares its idle with it: compare phases, never their sum."""
    out: dict[str, float] = {}
    for g0, g1 in gaps:
        covered = []
        for name, a, b in phases:
            lo, hi = max(g0, a), min(g1, b)
            if hi > lo:
                out[name] = out.get(name, 0.0) + (hi - lo) / 1e3
                covered.append((lo, hi))
        union = _union_us(covered)
        if g1 - g0 - union > 0:
            out["outside the phases"] = out.get("outside the phases", 0.0) + (g1 - g0 - union) / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


#: host ranges the idle is attributed to: the sharding phases and the optimizer's own ranges (``Optimizer.step#...``)
IDLE_PHASE_PREFIXES = PHASE_PREFIXES + ("Optimizer.",)


def idle_ms_by_phase(prof, spans: list[tuple[float, float]]) -> dict[str, float]:
    """``idle_by_phase`` of one profiled step (its device's ``spans``): where in the host's phases this rank's device
    waited."""
    phases = [(re.split(r" \(| \[| for |#", e.name)[0], e.time_range.start, e.time_range.end) for e in prof.events()
              if e.name.startswith(IDLE_PHASE_PREFIXES) and not str(e.device_type).endswith("CUDA")]
    return idle_by_phase(idle_gaps(spans), phases)


def profile_report(results: list[dict]) -> list[str]:
    """The markdown sections of the profiled steps: device time by kind, host time by phase, the host's waits."""
    lines: list[str] = []
    profiled = [r for r in results if (r.get("profile") or {}).get("device_ms_by_kind")]  # GPU kernels only
    if profiled:
        kinds = sorted({k for r in profiled for k in r["profile"]["device_ms_by_kind"]})
        lines += ["", "## Where the device time goes (rank 0, one profiled step, ms of kernel time)", "",
                  "busy s: time in which any kernel ran (union over streams); for the rest of the profiled step the "
                  "GPU idled (waiting for the host to launch work, or for another rank). The profiler slows the host, "
                  "so the profiled step is longer than the measured ones.", "",
                  "| workload | method | balance | profiled step s | busy s | " + " | ".join(kinds) + " |",
                  "|---|---|---|---|---|" + "---|" * len(kinds)]
        for r in profiled:
            by = r["profile"]["device_ms_by_kind"]
            busy = r["profile"].get("busy_ms")
            lines.append(f"| {r['workload']} | {r['method']} | {r['balance']} | {r['profile']['step_s']:.2f} | "
                         f"{'-' if busy is None else f'{busy / 1e3:.2f}'} | "
                         + " | ".join(f"{by.get(k, 0):.0f}" for k in kinds) + " |")
    return lines + idle_report(results) + host_phase_report(results) + host_wait_report(results)


def _section(title: str, note: str, columns: list[str], rows: list[str]) -> list[str]:
    """A markdown section of the profile report: ``## title``, ``note`` (if any), and a table (none without rows)."""
    if not rows:
        return []
    return ["", f"## {title}", ""] + ([note, ""] if note else []) + \
        ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + rows


def idle_report(results: list[dict]) -> list[str]:
    """The profiled step's device idle time by the host phase it fell in (``idle_ms_by_phase``)."""
    rows = [f"| {r['workload']} | {r['method']} | {phase} | {ms:.1f} |" for r in results
            for phase, ms in ((r.get("profile") or {}).get("idle_ms_by_phase") or {}).items()]
    return _section("When the device idles (rank 0, one profiled step, ms with no kernel running, by host phase)",
                    "Between the step's first kernel and its last; a phase inside another shares its idle with it. "
                    "The profiler slows the host, so idle the host causes is larger here than in the measured steps.",
                    ["workload", "method", "host phase", "idle ms"], rows)


def host_phase_report(results: list[dict]) -> list[str]:
    """The profiled step's host time per sharding phase (``host_by_phase``), one row per method and phase."""
    rows = [f"| {r['workload']} | {r['method']} | {phase} | {p['ms']:.1f} | {p['calls']} | {p['ms_per_call']:.3f} |"
            for r in results for phase, p in ((r.get("profile") or {}).get("host_ms_by_phase") or {}).items()]
    return _section("Where the host time goes (rank 0, one profiled step, per sharding phase)",
                    "CPU time inside each phase's profiler range, with what it called; a phase inside another is in "
                    "both. The profiler slows the host, so compare methods, not these with the measured steps.",
                    ["workload", "method", "phase", "host ms", "openings", "ms per opening"], rows)


def host_wait_report(results: list[dict]) -> list[str]:
    """The CUDA runtime calls in which the profiled step's host waited or copied (synchronisations, memcpys), by
    their own host time: where a step's time goes that no phase range holds."""
    rows = [f"| {r['workload']} | {r['method']} | {op['name']} | {op['self_ms']:.1f} | {op['calls']} |"
            for r in results for op in (r.get("profile") or {}).get("top_host_ops", [])
            if "ynchronize" in op["name"] or "Memcpy" in op["name"]]
    return _section("Where the host waits (rank 0, one profiled step, CUDA runtime calls)", "",
                    ["workload", "method", "call", "host ms", "calls"], rows)
