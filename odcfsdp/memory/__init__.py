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
  gathered group; ``grad_buffers``: the gradients of a backward not pushed yet (autograd's own tensors of a
  group's parameters from their backward to the group's push, then the push's buffer, the same size as the
  unsharded buffer: [fresh-grads]; or a zeroed buffer from the pre-backward, [grad-buffers]);
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
2G bf16 gradient buffer per group in backward, until its push has read it (at most two sites' buffers: the
site being pushed and the one backward fills, [streams] 2); the one-sided gather and scatter-accumulate need no
staging; ``collective`` adds an
all-gather staging buffer (2G) and a reduce-scatter input (4G, fp32) plus output (4G/N). FSDP2 holds the
bf16 cast of its shard (2G/N, the all-gather input), the all-gather output (2G) and the unsharded
parameters copied out of it (2G; both briefly), the bf16 unsharded gradients (2G, autograd's), the fp32
reduce-scatter input (4G) and output (4G/N, the first micro-batch's becomes the sharded gradient); the
next layer's prefetched all-gather doubles the unsharded part. DDP: fp32 parameters, gradients and
buckets (4P each), AdamW 8P, autocast's bf16 weight copies.

So at equal transients odcfsdp's default resident state is 2P/N (the rows) above FSDP2's. Its levers:
``gather_masters=True`` (the fp32 master is the row: 16P/N, [gather-masters]) and a bf16 ``reduce_dtype``
(accumulators 2P/N: 14P/N with both until the sync, 18P/N from the sync to the finish with the fp32 .grad copy),
or ``split_masters=True`` (the master held as the row plus 2P/N of low bits from a minibatch's first forward to
its sync: 16P/N there, 18P/N from the sync to the next minibatch's first forward, [split-masters]; the low bits
count as masters).
Activations follow each rank's largest micro-batch, which LB-Mini keeps small by spreading positions evenly
([even-packing] in ``odcfsdp/data/balance.py``). With one-sided transports 6P/N of it (rows, accumulators) is the
heap, which torch's peak statistics do not see: compare torch's peak *plus* the heap with FSDP2's peak. NVSHMEM
reserves 64 MiB beyond the heap (``HEAP_HEADROOM``) for its own use, and NCCL's buffers are outside torch as well.
Where each of these stood at the measured 8B peaks, row by row against FSDP2's: docs/design.md, "Where every byte
goes at the peak".
"""

from .live import MemoryBreakdown, known_tensors, memory_breakdown, odc_tensors, optimizer_tensors, span
from .peak import FRAME_RULES, classify_frames, peak_breakdown, replay_peak

__all__ = ["FRAME_RULES", "MemoryBreakdown", "classify_frames", "known_tensors", "memory_breakdown",
           "odc_tensors", "optimizer_tensors", "peak_breakdown", "replay_peak", "span"]
