"""``peak_breakdown``: a training step's peak by category, for any model (odcfsdp, FSDP2, DDP), from torch's
allocator history ([peak-replay]); ``replay_peak``: that replay as a pure function of a
``torch.cuda.memory._snapshot()`` dict. Categories: ``odcfsdp/memory/__init__.py``."""

from __future__ import annotations

import bisect
import os
from typing import Callable, Iterable, Mapping

import torch

from ..torch_private import memory_snapshot, record_memory_history
from .live import plain_tensors, span

_MARKER = "_probe_marker"  # the function whose allocation marks a probe in the trace

#: How a block alive at the peak is classified from its allocation frames (innermost first): the first frame
#: that matches a rule decides; rules are (category, path fragment, function names or None for any). Only code
#: that allocates and never calls a model's forward may have a rule (a forward's activations have the wrapper's
#: forward, DDP's included, among their outer frames).
FRAME_RULES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("unsharded_params", "odcfsdp/sharding/groups/group.py", ("to_unsharded",)),
    ("grad_buffers", "odcfsdp/sharding/groups/group.py", ("prepare_grad", "add_grad", "collect_late_grads")),
    ("grad_buffers", "odcfsdp/sharding/groups/fresh_grads.py", ("buffer_from_grads",)),  # [fresh-grads]
    ("masters", "odcfsdp/sharding/groups/split_master.py", None),  # a split master's low bits ([split-masters])
    ("comm_buffers", "odcfsdp/sharding/transport/", None),
    ("comm_buffers", "odcfsdp/kernels/", None),
    ("comm_buffers", "odcfsdp/sharding/transport/streams.py", None),
    ("comm_buffers", "odcfsdp/sharding/runtime/minibatch.py", None),  # the meetings, the sync, the finish
    ("comm_buffers", "odcfsdp/sharding/placement/mesh.py", None),
    ("comm_buffers", "odcfsdp/sharding/placement/collectives.py", None),
    ("unsharded_params", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py",
     ("alloc_storage", "init_unsharded_param", "init_all_gather_outputs", "alloc_all_gather_outputs")),
    ("comm_buffers", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py", ("all_gather_inputs",)),  # bf16 casts
    ("comm_buffers", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None),
    ("fsdp2_other", "torch/distributed/fsdp/_fully_shard/_fsdp_param", None),
    ("optimizer_state", "torch/optim/", ("_init_group",)),
    ("optimizer_step", "torch/optim/", None),
    ("grad_norm", "torch/nn/utils/clip_grad.py", None),
)


def classify_frames(frames: list[dict], rules=FRAME_RULES) -> str | None:
    """The category of the first frame (innermost first) that matches a rule, or None."""
    for f in frames or ():
        path, name = str(f.get("filename", "")).replace("\\", "/"), f.get("name", "")
        for category, fragment, names in rules:
            if fragment in path and (names is None or name in names):
                return category
    return None


def _is_marker(event: dict) -> bool:
    return any(f.get("name") == _MARKER and str(f.get("filename", "")).replace("\\", "/").endswith("memory/peak.py")
               for f in event.get("frames") or ())


def _site(frames: list) -> str:
    """Where a block was allocated, for reports: the innermost frame outside torch (else the innermost)."""
    f = next((f for f in frames if "/torch/" not in str(f.get("filename", ""))), frames[0] if frames else None)
    return "<no python frames>" if f is None else f"{os.path.basename(f['filename'])}:{f.get('line')}:{f.get('name')}"


def _initial_blocks(snapshot: dict, trace: list[dict], device: int) -> list[tuple[int, int, list]]:
    """Blocks alive when the trace starts: freed in it without an alloc in it, or alive in the snapshot's segments
    without an alloc in the trace that is still alive ((address, requested bytes, allocation frames))."""
    alive: dict[int, int] = {}
    initial = []
    for e in trace:
        if e["action"] == "alloc":
            alive[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            if alive.pop(e["addr"], None) is None:
                initial.append((e["addr"], e["size"], []))  # the free's frames are not the allocation's
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:  # block addresses: the segment's plus the sizes before (as the snapshot computes)
            if b["state"] in ("active_allocated", "active_pending_free") and addr not in alive:
                initial.append((addr, b.get("requested_size", b["size"]), b.get("frames") or []))
            addr += b["size"]
    return initial


def replay_peak(snapshot: dict, device: int = 0, probes: list[Mapping[str, list[tuple[int, int]]]] = (),
                rules=FRAME_RULES, top: int = 8) -> dict:
    """Replay a snapshot's device trace to its peak and attribute the blocks alive then (pure; see [peak-replay]).

    ``probes[k]``, the byte ranges ``(ptr, nbytes)`` of known tensors by category, labels the blocks alive at the
    k-th probe marker of the trace (an allocation from ``_probe_marker``) that contain a tensor's first byte.
    Returns bytes (requested, as the trace records them) at the start, the peak and the end, the peak's event
    index (-1: before the first event), bytes per category at the peak, the largest blocks there, and where
    the unclassified bytes were allocated.
    """
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    initial = _initial_blocks(snapshot, trace, device)
    labels: dict = {}
    markers: set[int] = set()

    def run(stop: int | None):
        live = {addr: (("init", k), size, frames) for k, (addr, size, frames) in enumerate(initial)}
        total = start = sum(b[1] for b in live.values())
        peak, peak_at, n_probe = total, -1, 0
        for i, e in enumerate(trace[: None if stop is None else stop + 1]):
            if e["action"] == "alloc":
                if _is_marker(e):
                    markers.add(e["addr"])
                    if stop is None and n_probe < len(probes):
                        _label(live, probes[n_probe], labels)
                    n_probe += 1
                    continue
                if e["addr"] in live:  # an alloc at a live address: the trace missed its free (wrapped buffer)
                    total -= live[e["addr"]][1]
                live[e["addr"]] = (i, e["size"], e.get("frames") or [])
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif e["action"] == "free_completed":
                if e["addr"] in markers:
                    markers.discard(e["addr"])
                elif (b := live.pop(e["addr"], None)) is not None:
                    total -= b[1]
        return live, start, peak, peak_at, total, n_probe

    _, start, peak, peak_at, end, n_probe = run(None)
    markers.clear()
    live, *_ = run(peak_at)
    categories: dict[str, int] = {}
    unclassified: dict[str, int] = {}
    blocks = []
    for bid, size, frames in live.values():
        cat = labels.get(bid) or classify_frames(frames, rules)
        site = _site(frames)
        if cat is None and isinstance(bid, tuple):
            cat = "preexisting_other"
        elif cat is None:
            cat, unclassified[site] = "activations_and_other", unclassified.get(site, 0) + size
        categories[cat] = categories.get(cat, 0) + size
        blocks.append((size, cat, site))
    blocks.sort(key=lambda b: -b[0])
    return {"start_bytes": start, "peak_bytes": peak, "end_bytes": end, "peak_event": peak_at, "events": len(trace),
            "probes_found": n_probe, "probes_given": len(probes),
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "largest_blocks": [{"bytes": s, "category": c, "site": w} for s, c, w in blocks[:top]],
            "unclassified_sites": dict(sorted(unclassified.items(), key=lambda kv: -kv[1])[:top])}


def _label(live: dict, probe: Mapping[str, list[tuple[int, int]]], labels: dict) -> None:
    """Label the live blocks holding each probed tensor's first byte with its category (first label wins)."""
    order = sorted((addr, addr + size, bid) for addr, (bid, size, _) in live.items())
    starts = [o[0] for o in order]
    for category, spans in probe.items():
        for ptr, _n in spans:
            k = bisect.bisect_right(starts, ptr) - 1
            if k >= 0 and ptr < order[k][1]:
                labels.setdefault(order[k][2], category)


def _probe_marker(device: torch.device) -> None:
    """One 1-byte allocation whose frames mark a probe's place in the allocator's trace (see [peak-replay])."""
    torch.empty(1, dtype=torch.uint8, device=device)  # freed at once


def _spans(known: Mapping[str, Iterable[torch.Tensor]], device: torch.device) -> dict[str, list[tuple[int, int]]]:
    return {cat: [(s[0], s[1] - s[0]) for t in plain_tensors(ts) if t.device == device and (s := span(t)) is not None]
            for cat, ts in known.items()}


def peak_breakdown(fn: Callable[[], object], known: Callable[[], Mapping] | Mapping | None = None, *,
                   optimizer: torch.optim.Optimizer | None = None, device: torch.device | None = None,
                   outside: Mapping[str, int] | None = None, rules=FRAME_RULES, max_entries: int = 4_000_000) -> dict:
    """Run ``fn`` (one training step) on CUDA and attribute the bytes alive at its peak (see [peak-replay]).

    Design note [peak-replay]
    -------------------------
    ``fn`` runs under ``torch.cuda.memory._record_memory_history(stacks="python")``; the snapshot's device
    trace (alloc / free_completed events, requested bytes, allocation frames) is replayed from the blocks
    alive when recording started (the snapshot's ``segments`` and frees without an alloc in the trace) to the
    moment of the peak. A block is memory until its ``free_completed`` (a block freed while another stream
    still used it is not reusable before). Each block alive then is classified: by address, if it holds a
    tensor of ``known`` (a mapping, or a callable returning one, {category: tensors}) at a probe: before
    ``fn``, at ``optimizer``'s step pre-hook (gradients complete) and after ``fn``, each marked in the trace by
    one tiny allocation; else by its allocation frames (``FRAME_RULES``); else ``preexisting_other`` (alive
    before ``fn``) or ``activations_and_other``. Blocks autograd allocates on its device thread carry no
    Python frames (FSDP2's and DDP's unsharded gradients), so they fall in ``activations_and_other`` unless
    known. Returns ``replay_peak``'s result plus torch's own peaks over ``fn`` (rounded block sizes, hence a
    little above the replayed peak) and ``outside`` (bytes outside torch's allocator, e.g. the heap).
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"peak_breakdown needs a CUDA device (the allocator's history), got {device}")
    probes: list[dict] = []

    def probe(*_args) -> None:
        probes.append(_spans((known() if callable(known) else known) or {}, device))
        _probe_marker(device)

    torch.cuda.synchronize(device)
    record = record_memory_history
    record("all", context="alloc", stacks="python", max_entries=max_entries, clear_history=True)
    handle = optimizer.register_step_pre_hook(probe) if optimizer is not None else None
    try:
        torch.cuda.reset_peak_memory_stats(device)
        probe()
        fn()
        torch.cuda.synchronize(device)
        probe()
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        snapshot = memory_snapshot()
    finally:
        if handle is not None:
            handle.remove()
        record(None)
    out = replay_peak(snapshot, device.index, probes, rules)
    if out["probes_found"] != len(probes):
        out["warning"] = (f"{out['probes_found']} probe markers in the trace for {len(probes)} probes: the trace "
                          "lost events (max_entries); attribution by address is unreliable")
    out.update(allocator_peak_bytes=allocated, reserved_peak_bytes=reserved, outside_torch=dict(outside or {}))
    return out


__all__ = ["FRAME_RULES", "classify_frames", "peak_breakdown", "replay_peak"]
