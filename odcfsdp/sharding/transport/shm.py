"""``shm`` transport: one-sided communication between CPU processes of one host.

Each rank's symmetric-heap region is a file in ``/dev/shm`` that every rank maps.
Gathers read peers' rows straight from the mappings; scatter-accumulate adds into
the owner's accumulator under a byte-range lock on the owner's file (one lock per
owner and group), so owners do no work and pushes to different groups or owners
proceed in parallel. It gives CI the exact one-sided semantics of ``nvshmem``:
ranks meet only where the step protocol says ([step-protocol]: once the loop
reads and consumes the minibatch's gradients) and may run different numbers of
micro-batches.

Design note [shm-cleanup]
-------------------------
1. rank r creates ``odcfsdp-<session>-r<r>-p<pid>`` (session: a random token from
   rank 0) and sizes it; 2. ranks exchange names and map every file; 3. after a
   barrier each rank unlinks its own file. From then on the memory lives only in
   the mappings and disappears with the processes, whatever way they end. A file
   left behind by a rank killed during set-up is removed by the next set-up on the
   host once its creator pid is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import tempfile
from pathlib import Path

import torch

from ..placement.mesh import ShardMesh
from .base import TransportCaps, as_bytes
from .heap import SymmetricHeap
from .one_sided import OneSidedTransport

_NAME = re.compile(r"^odcfsdp-[0-9a-f]+-r\d+-p(\d+)$")


def shm_dir() -> Path:
    """Where heap files live: /dev/shm where it exists (RAM-backed), else the temp dir."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def sweep_stale_heaps(directory: Path | None = None) -> list[Path]:
    """Remove heap files whose creating process no longer exists; return what was removed."""
    removed = []
    for path in (directory or shm_dir()).glob("odcfsdp-*"):
        m = _NAME.match(path.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except PermissionError:
            pass  # alive, owned by someone else
    return removed


class ShmHeap(SymmetricHeap):
    """Symmetric heap made of one shared-memory file per rank, mapped by every rank."""

    def __init__(self, nbytes: int, mesh: ShardMesh):
        super().__init__(nbytes, mesh.rank, mesh.world_size)
        rank = mesh.rank
        directory = shm_dir()
        sweep_stale_heaps(directory)
        session = mesh.broadcast_object(secrets.token_hex(8))
        own = directory / f"odcfsdp-{session}-r{rank}-p{os.getpid()}"
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._regions: list[torch.Tensor] = []
        fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            names = mesh.all_gather_object(str(own))
            for q, name in enumerate(names):
                qfd = fd if q == rank else os.open(name, os.O_RDWR)
                self.fds.append(qfd)
                self._maps.append(mmap.mmap(qfd, nbytes, mmap.MAP_SHARED))
                self._regions.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8))
            mesh.barrier()  # everyone has mapped every file
        finally:
            own.unlink()
        self._closed = False

    def region(self, q: int) -> torch.Tensor:
        return self._regions[q]

    @contextlib.contextmanager
    def locked(self, owner: int, key: int):
        """Exclusive lock number ``key`` of rank ``owner``'s region (across processes)."""
        fcntl.lockf(self.fds[owner], fcntl.LOCK_EX, 1, key)
        try:
            yield
        finally:
            fcntl.lockf(self.fds[owner], fcntl.LOCK_UN, 1, key)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._regions = []
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: unmapped when it dies
                m.close()
        for fd in self.fds:
            os.close(fd)
        self._maps, self.fds = [], []


class ShmTransport(OneSidedTransport):
    """One-sided transport over shared-memory files (CPU, one host)."""

    name = "shm"
    caps = TransportCaps(
        devices=("cpu",), uneven_micro_batches=True, spans_hosts=False, remote_pushes=True,
        where="CPU processes of one host",
        how=("each rank's heap is a `/dev/shm` file mapped by all ranks (unlinked right after set-up, so nothing is "
             "left behind even on a crash); locked adds"))

    def _make_heap(self, nbytes: int) -> ShmHeap:
        return ShmHeap(nbytes, self.mesh)

    def gather(self, g: int, out: torch.Tensor) -> None:
        lay = self.layouts[g]
        dst, src = [], []
        for seg_view, slot in zip(lay.unsharded_segments(as_bytes(out)), lay.slots):
            for q in range(self.world_size):
                dst.append(seg_view[q])
                src.append(as_bytes(self.peer_rows[q][g])[slot.offset : slot.offset + slot.shard])
        torch._foreach_copy_(dst, src)

    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        lay = self.layouts[g]
        if self.accumulators[g] is None:
            raise RuntimeError(f"group {g} holds frozen parameters and has no gradient accumulator")
        staging = lay.pack(grad, out=torch.empty(lay.unsharded_numel, dtype=self.accumulators[g].dtype))
        for step in range(self.world_size):
            owner = (self.rank + 1 + step) % self.world_size  # start at different owners: less lock contention
            with self.heap.locked(owner, g):
                self.peer_accs[owner][g].add_(staging[owner])
