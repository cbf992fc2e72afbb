"""``nvshmem`` transport: one-sided gather and scatter-accumulate between GPUs (NVSHMEM + Triton).

Rows and fp32 accumulators live on the NVSHMEM symmetric heap. Peers reachable by
load/store (GPUs of one NVLink node) are read and atomically added into through
peer pointers (``nvshmem_ptr``) by the Triton kernels of ``odcfsdp.kernels.rows``:
one launch per group fetches every rank's row and unpacks it into the
parameter-major buffer, or pushes every owner's segments into its accumulator.
Peers without a load/store path are gathered from with NVSHMEM get device calls
(``odcfsdp.kernels.nvshmem_get``); pushing gradients to them would need remote fp32
atomics, which NVSHMEM offers only through peer pointers, so training across such
peers is refused with a clear error. ``ODC_NVSHMEM_GATHER=kernel|copy_engine|get``
picks the gather explicitly (``get`` on NVLink peers is how it is tested).

Design note [nvshmem-runtime]
-----------------------------
NVSHMEM is initialised once per process (it is a process-wide library): the first
transport initialises it over its process group (unique id broadcast through
torch.distributed) with ``NVSHMEM_SYMMETRIC_SIZE`` computed from its plan plus
headroom, and it is finalised at exit. Every transport then allocates its heap
region with one collective ``nvshmem_malloc`` and frees it on ``close``. A plan
larger than the heap fails with an error naming the bytes needed and the variable
to set. NVLink multicast is never used (the host's shared GPUs require
``NVSHMEM_DISABLE_NVLS=1``; it is set here unless the user set it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Iterator

import torch

from ...kernels.chunks import group_chunk_table
from ...kernels.nvshmem_get import gather_rows_get
from ...kernels.rows import gather_rows, row_offsets, scatter_accumulate_rows
from ..placement.mesh import ShardMesh
from .heap import SymmetricHeap
from .base import TransportCaps, as_bytes, moved_as_bytes
from .one_sided import OneSidedTransport

HEAP_HEADROOM = 64 << 20  # NVSHMEM's own allocations share the heap

# The fastest of benchmarks/comm_bench.py's sweep on NVLink (its results: results/); change with NvshmemTransport.tune.
GATHER_BLOCK, GATHER_WARPS = 8192, 8
SCATTER_BLOCK, SCATTER_WARPS = 2048, 4
GATHER_MODES = ("kernel", "copy_engine", "get")
GET_CANNOT_CAST = ("NVSHMEM get calls copy bytes and cannot cast the fp32 masters peers hold with gather_masters=True: "
                   "use load/store peers (one NVLink node) or gather_masters=False")


class _NvshmemRuntime:
    """The process's NVSHMEM state: whether it is initialised, over how many PEs, with what heap."""

    def __init__(self) -> None:
        self.initialized = False
        self.n_pes = 0
        self.ranks: tuple[int, ...] = ()  # global ranks of the PEs, in PE order
        self.heap_bytes = 0
        self.in_use = 0

    def ensure(self, mesh: ShardMesh, need: int) -> None:
        """Initialise NVSHMEM over ``mesh``'s ranks if needed; check ``need`` more bytes fit in the heap."""
        ranks = tuple(mesh.global_rank(q) for q in range(mesh.world_size))
        if not self.initialized:
            self._init(mesh, need)
            self.ranks = ranks
        elif self.ranks != ranks:
            raise RuntimeError(
                f"NVSHMEM is already initialised in this process over ranks {list(self.ranks)}; a second ODCShard "
                f"over ranks {list(ranks)} cannot share it (one process group per process for comm='nvshmem')"
            )
        if self.in_use + need > self.heap_bytes:
            raise RuntimeError(
                f"the NVSHMEM symmetric heap has {self.heap_bytes - self.in_use} bytes free, this model needs {need}; "
                f"set NVSHMEM_SYMMETRIC_SIZE to at least {self.in_use + need + HEAP_HEADROOM} before the first ODCShard"
            )

    def _init(self, mesh: ShardMesh, need: int) -> None:
        try:
            import nvshmem.core
        except ImportError as e:
            raise ImportError("comm='nvshmem' needs nvshmem4py: pip install 'odcfsdp[cuda]' (nvshmem4py-cu13)") from e
        try:
            from cuda.core import Device
        except ImportError:  # cuda-core < 1.0
            from cuda.core.experimental import Device
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        uid = mesh.broadcast_object(nvshmem.core.get_unique_id(empty=mesh.rank != 0))
        with heap_size_env(need) as size:
            nvshmem.core.init(device=Device(mesh.device.index), uid=uid, rank=mesh.rank, nranks=mesh.world_size,
                              initializer_method="uid")
        self.heap_bytes = size - HEAP_HEADROOM
        self.initialized, self.n_pes = True, mesh.world_size
        atexit.register(self.finalize)

    def finalize(self) -> None:
        if self.initialized:
            import nvshmem.core

            self.initialized = False
            try:
                nvshmem.core.finalize()
            except Exception:  # noqa: BLE001 - at exit, peers may already be gone
                pass


@contextlib.contextmanager
def heap_size_env(need: int) -> Iterator[int]:
    """``NVSHMEM_SYMMETRIC_SIZE`` for NVSHMEM's initialisation; yields the heap size in bytes.

    The user's value if set; otherwise ``need`` plus headroom, set only while NVSHMEM
    initialises: left in ``os.environ`` it would reach processes started later (the
    ranks of a test, a data loader's workers), which would take it for the user's
    setting and size their heaps for this model instead of theirs.
    """
    preset = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if preset is not None:
        yield _parse_size(preset)
        return
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(need + HEAP_HEADROOM)
    try:
        yield need + HEAP_HEADROOM
    finally:
        del os.environ["NVSHMEM_SYMMETRIC_SIZE"]


def _parse_size(text: str) -> int:
    """NVSHMEM size syntax: a number with an optional K/M/G/T suffix (powers of 1024)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


RUNTIME = _NvshmemRuntime()


class NvshmemHeap(SymmetricHeap):
    """One NVSHMEM allocation per rank; peers' copies through ``nvshmem_ptr`` peer views."""

    def __init__(self, nbytes: int, mesh: ShardMesh):
        super().__init__(nbytes, mesh.rank, mesh.world_size)
        rank, world_size = mesh.rank, mesh.world_size
        import nvshmem.core

        RUNTIME.ensure(mesh, nbytes)
        try:
            self._local = nvshmem.core.tensor((nbytes,), dtype=torch.uint8)
        except Exception as e:
            raise RuntimeError(
                f"could not allocate {nbytes} bytes on the NVSHMEM symmetric heap ({e}); "
                f"set NVSHMEM_SYMMETRIC_SIZE to at least {nbytes + HEAP_HEADROOM}"
            ) from e
        RUNTIME.in_use += nbytes
        self._regions: list[torch.Tensor | None] = []
        for q in range(world_size):
            if q == rank:
                self._regions.append(self._local)
                continue
            peer = nvshmem.core.get_peer_tensor(self._local, q)
            # No load/store path to that GPU (another node): only NVSHMEM get/put reach it.
            self._regions.append(None if peer is None or peer.data_ptr() == 0 else peer)

    def region(self, q: int) -> torch.Tensor | None:
        return self._regions[q]

    def close(self) -> None:
        if self._local is None:
            return
        import nvshmem.core

        self._regions = []
        torch.cuda.synchronize(self._local.device)
        nvshmem.core.free_tensor(self._local)  # collective: every rank closes its transport
        RUNTIME.in_use -= self.nbytes
        self._local = None


class NvshmemTransport(OneSidedTransport):
    """One-sided transport over the NVSHMEM symmetric heap (CUDA, NVLink peers)."""

    name = "nvshmem"
    caps = TransportCaps(
        devices=("cuda",), uneven_micro_batches=True, spans_hosts=False, remote_pushes=True,
        where="GPUs of one NVLink node",
        how=("rows and fp32 accumulators on the NVSHMEM symmetric heap (size computed from the plan); one Triton "
             "kernel per group reads every rank's row through peer pointers and unpacks it (gather), or atomically "
             "adds each owner's segments into its accumulator (scatter-accumulate)"))

    def __init__(self, mesh: ShardMesh):
        super().__init__(mesh)
        self.gather_block, self.gather_warps = GATHER_BLOCK, GATHER_WARPS
        self.scatter_block, self.scatter_warps = SCATTER_BLOCK, SCATTER_WARPS
        # "kernel": one Triton launch reads peers' rows through peer pointers and unpacks;
        # "copy_engine": peer memcpys per segment; "get": NVSHMEM get calls (peers without load/store).
        self.gather_mode = os.environ.get("ODC_NVSHMEM_GATHER", "kernel")
        if self.gather_mode not in GATHER_MODES:
            raise ValueError(f"ODC_NVSHMEM_GATHER must be one of {GATHER_MODES}, got {self.gather_mode!r}")

    def _make_heap(self, nbytes: int) -> NvshmemHeap:
        return NvshmemHeap(nbytes, self.mesh)

    def _allocate(self, layouts):
        rows, accs = super()._allocate(layouts)
        unreachable = [q for q in range(self.world_size) if self.heap.region(q) is None]
        if unreachable:
            if any(lay.requires_grad for lay in layouts):
                raise RuntimeError(
                    f"ranks {unreachable} are not load/store reachable from rank {self.rank} (no NVLink/P2P path): "
                    "scatter-accumulate needs remote fp32 atomics, which NVSHMEM offers only through peer pointers; "
                    "train within one NVLink domain, or use comm='collective'"
                )
            self.gather_mode = "get"
        if self.gather_mode == "get" and self.gather_dtype is not None and \
                any(d != self.gather_dtype and not moved_as_bytes(d) for d in self.row_dtypes):  # bytes: no cast
            raise RuntimeError(GET_CANNOT_CAST)
        if self.gather_mode != "get":
            self.row_offsets = [
                row_offsets(rows[g], [self.peer_rows[q][g] for q in range(self.world_size)])
                for g in range(len(layouts))
            ]
        self.acc_offsets = [
            row_offsets(accs[g], [self.peer_accs[q][g] for q in range(self.world_size)]) if lay.requires_grad else None
            for g, lay in enumerate(layouts)
        ]
        self.tune(self.gather_block, self.gather_warps, self.scatter_block, self.scatter_warps)
        torch.cuda.synchronize(self.device)  # the heap is zeroed before any peer can read it
        return rows, accs

    def tune(self, gather_block: int, gather_warps: int, scatter_block: int, scatter_warps: int) -> None:
        """Set the kernels' block sizes and warps (rebuilding the chunk tables they depend on)."""
        self.gather_block, self.gather_warps = gather_block, gather_warps
        self.scatter_block, self.scatter_warps = scatter_block, scatter_warps

        def tables(block):
            return [group_chunk_table(lay, block, self.device) for lay in self.layouts]

        self.gather_chunks, self.scatter_chunks = tables(gather_block), tables(scatter_block)

    def gather(self, g: int, out: torch.Tensor) -> None:
        if self.gather_mode == "copy_engine":
            self._gather_copy_engine(g, out)
            return
        # one-byte floating rows (float8) go through the kernels as bytes: one byte an element either way, so the
        # offsets and chunk tables (in elements) hold as they are
        row, out = as_bytes(self.rows[g]), as_bytes(out)
        if self.gather_mode == "get":
            if row.dtype != out.dtype:
                raise RuntimeError(GET_CANNOT_CAST)
            gather_rows_get(row, out, self.gather_chunks[g], self.world_size, self.rank, num_warps=self.gather_warps)
            return
        gather_rows(row, self.row_offsets[g], out, self.gather_chunks[g], self.world_size,
                    num_warps=self.gather_warps, rank=self.rank)

    def _gather_copy_engine(self, g: int, out: torch.Tensor) -> None:
        """One peer memcpy per (parameter, rank): DMA engines move the data, SMs stay free for compute (with
        ``gather_masters`` the copy also casts, which torch runs as a kernel on the SMs)."""
        lay = self.layouts[g]
        for seg_view, slot in zip(lay.unsharded_segments(out), lay.slots):
            for step in range(self.world_size):
                q = (self.rank + 1 + step) % self.world_size
                seg_view[q].copy_(self.peer_rows[q][g][slot.offset : slot.offset + slot.shard])

    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        if self.acc_offsets[g] is None:
            raise RuntimeError(f"group {g} holds frozen parameters and has no gradient accumulator")
        scatter_accumulate_rows(self.accumulators[g], self.acc_offsets[g], grad, self.scatter_chunks[g],
                                self.world_size, num_warps=self.scatter_warps, rank=self.rank)

    def quiesce(self) -> None:
        # atomics and row updates are done (system scope) once their kernels are. The callers order every such
        # write on the current stream first (pushes_done waits for the push stream; rows are written on it), so
        # its completion is theirs: other streams' work (a parked optimizer's copies, [parking]) goes on
        torch.cuda.current_stream(self.device).synchronize()
