"""Gather through NVSHMEM get device calls, for peers whose memory is not load/store reachable.

Same work split and result as ``rows.gather_rows``; a remote chunk is fetched with
``nvshmemx_getmem_nbi_block`` from the peer's copy of the caller's own (symmetric)
row address, straight into the parameter-major buffer, and ``nvshmem_quiet``
completes it. Needs CUDA, nvshmem4py and the device library
``libnvshmem_device.bc`` shipped with nvidia-nvshmem.

Design note [nvshmem-module-init]: a Triton module that links the NVSHMEM device
library must be registered with NVSHMEM (``cumodule_init``) before its first
launch, or its device-side NVSHMEM state is missing. Triton offers no hook for
that, so ``enable_nvshmem_modules`` wraps ``CompiledKernel._init_handles`` once per
process (the only place a module handle appears before launch).
"""

from __future__ import annotations

import functools
import pathlib

import torch
import triton
import triton.language as tl
from triton.language import core

from .chunks import ChunkTable
from .rows import _align, _check, _this_chunk


@functools.cache
def device_library() -> str:
    """Path of ``libnvshmem_device.bc``."""
    import nvidia.nvshmem

    path = pathlib.Path(nvidia.nvshmem.__path__[0]) / "lib" / "libnvshmem_device.bc"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the NVSHMEM get path needs nvidia-nvshmem's device library")
    return str(path)


@functools.cache
def enable_nvshmem_modules() -> None:
    """Register every Triton module linking the NVSHMEM device library with NVSHMEM (once per process)."""
    import nvshmem.bindings
    import triton.compiler.compiler as cc

    lib = device_library()
    original = cc.CompiledKernel._init_handles
    done: set = set()

    def init_handles(self):
        original(self)
        key = (self.name, self.module)
        if key not in done and any(path == lib for _, path in self.metadata.extern_libs):
            nvshmem.bindings.nvshmem.cumodule_init(self.module)
            done.add(key)

    cc.CompiledKernel._init_handles = init_handles


@core.extern
def _getmem_nbi_block(dest, src, nbytes, pe, _semantic=None):
    return core.extern_elementwise(
        "libnvshmem", device_library(), [dest, src, nbytes, pe],
        {(tl.int64, tl.int64, tl.uint64, tl.int32): ("nvshmemx_getmem_nbi_block", tl.int32)},
        is_pure=False, _semantic=_semantic,
    )


@core.extern
def _quiet(_semantic=None):
    return core.extern_elementwise("libnvshmem", device_library(), [], {(): ("nvshmem_quiet", tl.int32)},
                                   is_pure=False, _semantic=_semantic)


@triton.jit
def _gather_get_kernel(
    base,  # *T: the caller's own row; its address is symmetric, valid on every PE
    out,  # *T [N*C]: parameter-major unsharded buffer
    chunks,  # *int64 [num_chunks, 4]: see chunks.py
    world_size,  # N
    first,  # rank served by program 0
    my_pe,  # the caller's PE
    ELEM_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r, row_start, length, dst = _this_chunk(chunks, world_size, first, ALIGN, DST_ALIGN)
    if r == my_pe:
        offs = tl.arange(0, BLOCK)
        mask = offs < length
        tl.store(out + dst + offs, tl.load(base + row_start + offs, mask=mask), mask=mask)
    else:
        _getmem_nbi_block((out + dst).to(tl.int64), (base + row_start).to(tl.int64),
                          (length * ELEM_BYTES).to(tl.uint64), r.to(tl.int32))
        _quiet()


def gather_rows_get(base: torch.Tensor, out: torch.Tensor, chunks: ChunkTable, world_size: int, my_pe: int,
                    num_warps: int = 8) -> None:
    """``gather_rows`` for peers reachable only through NVSHMEM (``base`` on the symmetric heap)."""
    _check(torch.zeros(world_size, dtype=torch.int64, device=out.device), out, chunks, world_size)
    enable_nvshmem_modules()
    if chunks.num_chunks:
        _gather_get_kernel[(chunks.num_chunks * world_size,)](
            base, out, chunks.table, world_size, (my_pe + 1) % world_size, my_pe,
            ELEM_BYTES=out.element_size(), ALIGN=_align(out.dtype), DST_ALIGN=chunks.dst_align(_align(out.dtype)),
            BLOCK=chunks.block, num_warps=num_warps,
            extern_libs={"libnvshmem": device_library()},
        )
