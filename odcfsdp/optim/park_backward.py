"""A parked optimizer's state brought back under the last micro-batch's backward, into the memory it frees.

Design note [park-backward]
---------------------------
Parking ([parking] in ``parking.py``) brings the state back once the micro-batches are done, under the meeting.
The rank every other one waits for there has nothing to hide those copies under: its step waits for about S_p / B
(S_p the parked bytes, B the host-to-device rate of PCIe; docs/design.md, Figures behind the design notes). Its
last backward frees memory as it goes, each unit's saved activations once that unit's gradients are done, and
the state can come back into it, its copies running under the rest of the backward:

0. **Order.** What a backward frees is about its micro-batch's saved activations, which grow with its positions,
   and the balancers order a rank's micro-batches largest first, so the last was the smallest. A loop that asks
   ``wants_largest_last(optimizer)`` (a share parked, on a device whose memory reads) runs its largest micro-batch
   last instead (``odcfsdp.loop.plan_step``'s ``largest_last``; the CLI and ``e2e_bench`` do): the most room, and
   the smallest micro-batches first, beside the copies out of the step before ([park-trickle]). The sum of the
   gradients is the same in any order (up to floating-point association with three or more micro-batches), and so
   is each micro-batch's peak.
1. **Level.** After each unit's backward of the last micro-batch (the model's ``register_post_backward_hook``),
   read the bytes torch has allocated, a_k. The level is the highest reading so far, L = max a_j (j <= k): the
   first unit's, as a backward frees more than it keeps. A reading before the backward's first push does not
   count (the model's ``backward_pushes``): the hook fired for a site whose gradients are not all in, its
   transient still allocated (on a GPU at 9c2e4af the head's first reading was 6 MB above every layer's, and
   filling to it raised the peak by the 6 MB that came back; 4ca0138 skipped it where no push buffer was held,
   which covered bounded pushes only).
2. **Room.** Start bringing back the next parked tensors, in order, while their blocks fit in L - a_k - h_k
   (``bring_back_within``): each block is allocated on the backward's stream and filled on the parking's side
   stream after the work queued so far. From then on a_k counts them. h_k is the bytes of gradient buffers held
   for pushes in flight at the reading (``gradient_bytes_in_flight``: with pushes bounded to one site in flight,
   unit k's own buffer, [streams] 2), see below; their bytes, not their blocks' (within 512 bytes a buffer);
   0 where pushes are not held (unbounded, none in flight, no push stream).
3. **The rest.** ``prefetch_parked`` once the micro-batches are done brings back what did not fit, as before.

Why the peak does not rise. Between units the allocated bytes are a_k; inside a unit's backward they rise by a
transient T_k (its recomputed activations, its gathered parameters and gradient buffers) and fall back. The
backward's peak is at least L + T_1 (the first unit, before anything came back). A decoder's units are alike, so
T_k is about T_1, and filling to the level keeps every later unit's a_k + T_k at or under L + T_k: the peak and
its reading by the fitted share ([park-fit], which counts what came back here as not resident) are the run's
without this. Both count the allocator's blocks, so they agree to the byte.

Why h_k is left unfilled. The first unit's backward runs with no earlier unit's buffer held; every later one holds
the unit before's (h_k) until its own push is queued. With [fresh-grads] (``fresh_grads.py``) that push is a
transient of its own: autograd's gradients G and the buffer B they are copied into live together, so unit k+1
peaks at its push at a_k + G + B, with h_k = B still held, while unit 1 peaked at a_1 + G (a_1 counts B_1 already).
Filling to L - h_k keeps a_k + G + B at or under L + G, unit 1's own. Measured on a GPU at 7c802f1, filling to L
raised the peak by exactly one layer's buffer (6.3 MB, tests/test_gpu_parking.py's 4-layer model).

What it hides: min(S_p, F) of the copies back, where F is what the last backward frees above the level: about
that micro-batch's saved activations (one hidden state per unit with recomputation). A rank whose last
micro-batch is short frees little and waits as before; the last rank of a long-tailed minibatch runs a long one.
The copies share the backward's time with its gathers and pushes, but not their link (PCIe, not NVLink). Units
are known to the sharding wrapper only: for other models (FSDP2, DDP) nothing comes back early.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .parking import ParkedOptimizerState, Where, parking_of


class BackwardReturn:
    """Steps 1-2 of [park-backward], one call after each unit's backward: keep the level, fill the room.

    Args:
        parking: the optimizer's parked state (its device's allocated bytes are read).
        in_flight: the bytes of gradient buffers held for pushes in flight at a reading (the model's
            ``gradient_bytes_in_flight``; None where pushes are not held), left unfilled (step 2). None: pushes
            are never held.
        pushed: the pushes of the backward so far (the model's ``backward_pushes``); a reading before the first
            does not count (step 1). None: every reading counts.
    """

    def __init__(self, parking: ParkedOptimizerState, in_flight: Callable[[], int | None] | None = None,
                 pushed: Callable[[], int] | None = None):
        self.parking = parking
        self.in_flight = in_flight
        self.pushed = pushed
        self.level: int | None = None
        self.brought = 0  # bytes of blocks allocated here

    def __call__(self) -> None:
        allocated = self.parking.memory.allocated(self.parking.device)
        if allocated is None or self.parking.where is not Where.PARKED:
            return
        if self.pushed is not None and self.pushed() == 0:  # nothing of this backward pushed yet (step 1)
            return
        if self.level is None or allocated >= self.level:
            self.level = allocated
            return
        room = self.level - allocated - ((self.in_flight and self.in_flight()) or 0)  # h_k: None where not held
        if room > 0:
            self.brought += self.parking.bring_back_within(room)


def wants_largest_last(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s parked state may come back under the last backward, so that its largest micro-batch
    should run last ([park-backward] 0): it is parked under ``under_backward``, some share of it at least (a fitted
    share of 0 parks nothing), on a device whose allocated bytes can be read (not the CPU)."""
    parking = parking_of(optimizer)
    return (parking is not None and parking.under_backward and (parking.fraction > 0 or parking.away)
            and parking.memory.allocated(parking.device) is not None)


@contextlib.contextmanager
def returning_under_backward(optimizer: torch.optim.Optimizer,
                             register: Callable[[Callable[[], None]], object] | None,
                             in_flight: Callable[[], int | None] | None = None,
                             pushed: Callable[[], int] | None = None) -> Iterator[None]:
    """Around the last micro-batch's forward and backward: its units' backward bring the parked state back
    ([park-backward]). ``register`` is the model's ``register_post_backward_hook`` (None: a model without units,
    nothing comes back early), ``in_flight`` its ``gradient_bytes_in_flight`` (step 2), ``pushed`` its
    ``backward_pushes`` (step 1); nothing either for an optimizer without parking, or with ``under_backward`` off."""
    parking = parking_of(optimizer)
    if register is None or parking is None or not parking.under_backward or parking.where is not Where.PARKED:
        yield
        return
    handle = register(BackwardReturn(parking, in_flight, pushed))
    try:
        yield
    except BaseException:
        parking.settle()  # a failed pass: what came back early goes back to the host (its values are there)
        raise
    finally:
        handle.remove()
