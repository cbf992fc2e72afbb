"""Where a rank's memory goes: an ``ODCShard`` model's bytes by category now, and a training step's peak by category.

* ``memory_breakdown(model, optimizer)``: bytes per category of an ``ODCShard`` model at the moment of
  the call, from its live tensors (every byte counted once: views and aliases such as a master that
  *is* the row are deduplicated by address);
* ``peak_breakdown(fn, known)`` (CUDA, any model: odcfsdp, FSDP2, DDP): run ``fn`` (one step) under
  torch's allocator history and attribute the blocks alive at its peak ([peak-replay]);
* ``replay_peak(snapshot, ...)``: that replay, a pure function of a ``torch.cuda.memory._snapshot()`` dict.

Categories (``memory_breakdown``; N ranks per shard group, P parameters; "heap": outside torch's allocator):

* ``masters``: fp32 master rows the optimizer updates that are not the communicated row: 4P/N (0 when
  ``param_dtype`` is fp32: the row is the master); ``rows``: the communicated rows (bf16: 2P/N) and
  ``accumulators``: fp32 gradient accumulators of trained groups (4P/N), on the heap for one-sided transports;
  ``heap_other``: heap bytes beyond them (256-byte alignment); ``heap``: ``transport.heap_bytes`` (0 for
  ``collective``);
* ``optimizer_state``: every tensor in ``optimizer.state`` on the rows' device (DTensors: their local
  tensors): AdamW 8P/N plus one 4-byte ``step`` per parameter;
* ``unsharded_params``: unsharded buffers resident now (in use or prefetched): 2 bytes x N x row length per
  gathered group; ``grad_buffers``: gradient buffers in flight during backward (the same size, one per group
  between its pre-backward and its push);
* on CUDA also ``torch_allocated`` (``torch.cuda.memory_allocated``), ``activations_and_other`` (that minus
  the torch-allocated categories above: activations, autograd's saved tensors, caches, block rounding) and
  ``allocator_slack`` (reserved - allocated).

Design note [memory-model]
--------------------------
Bytes per parameter per rank (fp32 parameters, bf16 compute, fp32 gradient reduction, AdamW, N ranks):

======================  =================  ==================  ======================================
category                odcfsdp one-sided  odcfsdp collective  FSDP2
======================  =================  ==================  ======================================
fp32 params (masters)   4P/N torch         4P/N torch          4P/N torch (its sharded parameters)
bf16 rows               2P/N heap          2P/N torch          -
fp32 gradients          4P/N heap          4P/N torch          4P/N torch, first reduce-scatter to
                        (accumulators, resident for the run)   ``zero_grad`` (sharded ``.grad``)
AdamW moments           8P/N torch         8P/N torch          8P/N torch (resident after step 1)
resident sum            18P/N              18P/N               16P/N (12P/N before the first
                                                               reduce-scatter of a minibatch)
======================  =================  ==================  ======================================

Transient, per group (odcfsdp, ``group_bytes`` of bf16 each) or per layer (FSDP2), G elements: odcfsdp
holds 2G unsharded bf16 per gathered group (the hook site's groups plus ``prefetch`` sites ahead) and a
2G bf16 gradient buffer per group in backward, until its push has read it (the push stream may hold it
a little longer); the one-sided gather and scatter-accumulate need no staging; ``collective`` adds an
all-gather staging buffer (2G) and a reduce-scatter input (4G, fp32) plus output (4G/N). FSDP2 holds the
bf16 cast of its shard (2G/N, the all-gather input), the all-gather output (2G) and the unsharded
parameters copied out of it (2G; both briefly), the bf16 unsharded gradients (2G, autograd's), the fp32
reduce-scatter input (4G) and output (4G/N, the first micro-batch's becomes the sharded gradient); the
next layer's prefetched all-gather doubles the unsharded part. DDP: fp32 parameters, gradients and
buckets (4P each), AdamW 8P, autocast's bf16 weight copies.

So at equal transients odcfsdp's default resident state is 2P/N (the rows) above FSDP2's. Its levers:
``gather_masters=True`` (the fp32 master is the row: 16P/N, [gather-masters]) and a bf16 ``reduce_dtype``
(accumulators 2P/N: 14P/N with both until the sync, 18P/N from the sync to the finish with the fp32 .grad copy). Activations follow each rank's largest micro-batch,
which LB-Mini keeps small by spreading positions evenly ([even-packing] in ``odcfsdp/data/balance.py``). With one-sided transports 6P/N of it (rows, accumulators) is the heap, which torch's peak
statistics do not see: compare torch's peak *plus* the heap with FSDP2's peak. NVSHMEM reserves 64 MiB
beyond the heap (``HEAP_HEADROOM``) for its own use, and NCCL's buffers are outside torch as well.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from .sharding import ODCShard

_MARKER = "_probe_marker"  # the function whose allocation marks a probe in the trace

#: How a block alive at the peak is classified from its allocation frames (innermost first): the first frame
#: that matches a rule decides; rules are (category, path fragment, function names or None for any). Only code
#: that allocates and never calls a model's forward may have a rule (a forward's activations have the wrapper's
#: forward, DDP's included, among their outer frames).
FRAME_RULES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("unsharded_params", "odcfsdp/sharding/group.py", ("to_unsharded",)),
    ("grad_buffers", "odcfsdp/sharding/group.py", ("prepare_grad", "add_grad", "collect_late_grads")),
    ("comm_buffers", "odcfsdp/sharding/transport/", None),
    ("comm_buffers", "odcfsdp/kernels/", None),
    ("comm_buffers", "odcfsdp/sharding/streams.py", None),
    ("comm_buffers", "odcfsdp/sharding/protocol.py", None),
    ("comm_buffers", "odcfsdp/sharding/mesh.py", None),
    ("comm_buffers", "odcfsdp/sharding/collectives.py", None),
    ("unsharded_params", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py",
     ("alloc_storage", "init_unsharded_param", "init_all_gather_outputs", "alloc_all_gather_outputs")),
    ("comm_buffers", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py", ("all_gather_inputs",)),  # bf16 casts
    ("comm_buffers", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None),
    ("fsdp2_other", "torch/distributed/fsdp/_fully_shard/_fsdp_param", None),
    ("optimizer_state", "torch/optim/", ("_init_group",)),
    ("optimizer_step", "torch/optim/", None),
    ("grad_norm", "torch/nn/utils/clip_grad.py", None),
)


# -- live breakdown of an ODCShard model --------------------------------------------------------------------------
@dataclass
class MemoryBreakdown:
    """Bytes per category of one rank at one moment (see the module's docstring); None: not measured (CPU)."""

    masters: int
    rows: int
    accumulators: int
    heap_other: int
    heap: int
    optimizer_state: int
    unsharded_params: int
    grad_buffers: int
    outside_torch: tuple[str, ...]  # categories that live outside torch's allocator (on the heap)
    torch_allocated: int | None = None
    activations_and_other: int | None = None
    allocator_slack: int | None = None

    def as_dict(self) -> dict:
        return {**asdict(self), "outside_torch": list(self.outside_torch)}


class _Claims:
    """Byte ranges counted so far (sorted, disjoint): each byte is counted once, by the first category claiming it."""

    def __init__(self):
        self._iv: list[tuple[int, int]] = []

    def claim(self, lo: int, hi: int) -> int:
        """Mark ``[lo, hi)`` counted; return how many of its bytes were not counted before."""
        if hi <= lo:
            return 0
        iv = self._iv
        i = bisect.bisect_right(iv, (lo, float("inf"))) - 1
        if i < 0 or iv[i][1] < lo:
            i += 1
        covered, new_lo, new_hi, j = 0, lo, hi, i
        while j < len(iv) and iv[j][0] <= hi:
            a, b = iv[j]
            covered += max(0, min(b, hi) - max(a, lo))
            new_lo, new_hi, j = min(new_lo, a), max(new_hi, b), j + 1
        iv[i:j] = [(new_lo, new_hi)]
        return hi - lo - covered


def _local(t):
    """A DTensor's local tensor (no autograd op), any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def span(t: torch.Tensor | None) -> tuple[int, int] | None:
    """The bytes ``[lo, hi)`` a tensor's elements occupy, within its storage's allocated bytes (None: no bytes)."""
    if t is None:
        return None
    t = _local(t)
    if t.is_meta or t.numel() == 0:
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:  # a freed unsharded buffer ([storage-resize])
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    hi = min(lo + extent * t.element_size(), storage.data_ptr() + storage.nbytes())
    return (lo, hi) if hi > lo else None


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (DTensors: their local tensors)."""
    if optimizer is None:
        return []
    return [_local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def odc_tensors(model: ODCShard, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """An ``ODCShard`` model's tensors by category, in the order they are counted (see ``memory_breakdown``)."""
    groups = [g for g in model.groups if g.row is not None]
    device = groups[0].row.device if groups else None
    return {
        "rows": [g.row for g in groups],
        "accumulators": [g.accumulator for g in groups if g.accumulator is not None],
        "masters": [g.master for g in groups if g.master is not g.row],
        "optimizer_state": [t for t in optimizer_tensors(optimizer) if t.device == device],
        "unsharded_params": [g.unsharded for g in groups],
        "grad_buffers": [g.grad_buffer for g in groups if g.grad_buffer is not None],
    }


def memory_breakdown(model: ODCShard, optimizer: torch.optim.Optimizer | None = None) -> MemoryBreakdown:
    """Bytes per category of an ``ODCShard`` model on this rank now (see the module's docstring); no communication."""
    if not isinstance(model, ODCShard):
        raise TypeError(f"memory_breakdown takes an ODCShard model, got {type(model).__name__}")
    claims, tensors = _Claims(), odc_tensors(model, optimizer)
    counted = {cat: sum(claims.claim(*s) for t in ts if (s := span(t)) is not None) for cat, ts in tensors.items()}
    heap = int(getattr(model.transport, "heap_bytes", 0) or 0)
    outside = ("rows", "accumulators", "heap_other") if heap else ()
    out = MemoryBreakdown(**counted, heap=heap, heap_other=heap - counted["rows"] - counted["accumulators"] if heap
                          else 0, outside_torch=outside)
    device = model.groups[0].row.device if model.groups and model.groups[0].row is not None else None
    if device is not None and device.type == "cuda":
        out.torch_allocated = torch.cuda.memory_allocated(device)
        host = {k for k, ts in tensors.items() if ts and all(t.device.type == "cpu" for t in ts)}  # offloaded
        inside = sum(v for k, v in counted.items() if k not in outside and k not in host)
        out.activations_and_other = out.torch_allocated - inside
        out.allocator_slack = torch.cuda.memory_reserved(device) - out.torch_allocated
    return out


def known_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, list[torch.Tensor]]:
    """Tensors ``peak_breakdown`` recognises by address: an ``ODCShard`` model's categories, or any other model's
    parameters (``masters``: FSDP2's sharded fp32 parameters, DDP's full ones), gradients and optimizer state."""
    if isinstance(model, ODCShard):
        return odc_tensors(model, optimizer)
    params = list(model.parameters())
    return {"masters": [_local(p) for p in params],
            "gradients": [_local(p.grad) for p in params if p.grad is not None],
            "optimizer_state": optimizer_tensors(optimizer)}


# -- the peak of a step, from the allocator's trace -----------------------------------------------------------------
def classify_frames(frames: list[dict], rules=FRAME_RULES) -> str | None:
    """The category of the first frame (innermost first) that matches a rule, or None."""
    for f in frames or ():
        path, name = str(f.get("filename", "")).replace("\\", "/"), f.get("name", "")
        for category, fragment, names in rules:
            if fragment in path and (names is None or name in names):
                return category
    return None


def _is_marker(event: dict) -> bool:
    return any(f.get("name") == _MARKER and str(f.get("filename", "")).endswith("memory.py")
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
    return {cat: [(s[0], s[1] - s[0]) for t in ts if t is not None and _local(t).device == device
                  and (s := span(t)) is not None] for cat, ts in known.items()}


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
    record = torch.cuda.memory._record_memory_history
    record("all", context="alloc", stacks="python", max_entries=max_entries, clear_history=True)
    handle = optimizer.register_step_pre_hook(probe) if optimizer is not None else None
    try:
        torch.cuda.reset_peak_memory_stats(device)
        probe()
        fn()
        torch.cuda.synchronize(device)
        probe()
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        snapshot = torch.cuda.memory._snapshot()
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


__all__ = ["FRAME_RULES", "MemoryBreakdown", "classify_frames", "known_tensors", "memory_breakdown",
           "odc_tensors", "optimizer_tensors", "peak_breakdown", "replay_peak", "span"]
