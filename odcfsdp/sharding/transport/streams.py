"""Where a group's gathers and pushes run relative to compute: the side streams and their events.

Design note [streams]
---------------------
On CUDA a prefetch gathers on a side stream while the current site computes, and
pushes run on another side stream while backward goes on (FSDP2's comm context
holds the same two streams). Everything about streams and events lives here, so the
groups, the hooks and the step protocol only say *what* to move and *when it must be
done*:

1. ``gather(g, out, ahead=True)`` queues the gather on the gather stream after the
   work queued so far on the current stream (the block ``out`` reuses is free once
   that work is done), and returns an event; ``wait(event)`` makes the current stream
   wait for it before ``out`` is used or freed. Without a side stream (CPU, or
   ``prefetch=0``) the gather runs in place and there is no event.
2. ``push(g, grad)`` queues the scatter-accumulate on the push stream after the
   current stream's work (which wrote ``grad``), which must not be reused before the push
   has read it. Freed with ``record_stream``, the allocator reuses such a block only once the
   host sees that push done, and the host runs layers ahead, so where backward outruns
   the pushes their buffers pile up, several layers' worth at the peak (the measured bytes: docs/design.md,
   Memory and precision). So pushes are bounded per site by default (``pushes_in_flight = 1``,
   ``PUSHES_IN_FLIGHT``), as FSDP2 bounds its reduce-scatters per unit: once a site's groups are pushed
   (``site_pushed``, step 6 of [lifecycle]) the current stream waits for the previous
   site's pushes, and only then are that site's buffers dropped (no ``record_stream``:
   their blocks go back to the current stream's pool and are reused in stream order).
   So two sites' buffers live at most, the ones being pushed and the ones backward
   fills next. The wait stalls compute only where the pushes fall behind, and then the
   step would have waited for the same pushes at ``pushes_done``. At the end of a
   backward (``backward_done``) and when the streams are dropped, the buffers still
   held go back to ``record_stream``: none is kept into the next micro-batch's forward.
   ``pushes_in_flight = None`` (``model.comm.pushes_in_flight``; the e2e bench's ``unbounded_pushes`` variant)
   frees each buffer with ``record_stream`` instead. With the collective transport a push is a
   reduce-scatter, so the wait is for a collective every rank issues in the same order: ranks must run
   equal micro-batch counts there anyway.
3. ``pushes_done()`` (before a meeting): the current stream waits for the pushes and the gathers,
   and the transport makes them complete and visible to their owners: it waits for the current stream
   only, so work on streams that are not the model's (a parked optimizer's copies) goes on.
4. ``rows_published()`` (after a finish or a change): the transport makes the new
   rows visible, and later prefetches (side stream) start after them.
5. ``zero_before_meeting`` / ``zero_after_meeting`` (around a finish's or a change's meeting):
   the accumulators must be zero before any rank's next push. Without a push stream
   they are zeroed before the meeting, which orders that. With one, the meeting comes
   first, then the zeroing runs on the push stream after the current stream's work
   (the step read the accumulators), followed on the same stream, where pushes are
   one-sided (``TransportCaps.remote_pushes``), by one device-side all-reduce of a zero
   flag over the shard group: pushes queued later on any rank's push stream start
   after that all-reduce, so after every owner has zeroed, and the host waits for
   nothing (the collective transport needs no barrier: each owner adds its own reduced
   share, after its own zeroing on the same stream). Zeroing, 4 of the 44 bytes per
   parameter of an AdamW step with ``gather_masters`` (``benchmarks/optim_bench.py``),
   so leaves the step and runs under the next forward. A rank's own reads of its
   accumulators (the sync) come after ``pushes_done``, so after it too. Whoever times
   a step waits for the current stream only (``loop.train_step``); a device-wide sync
   would wait for the zeroing too. The standard loop's ``zero_grad()`` after the step
   meets nobody and waits for nothing ([zero-grad-pass] in ``protocol.py``).
6. ``late_rows_written`` (float8 rows, [float8-gather] in ``float8.py``): the owner casts its float8 rows
   *after* the meeting (the scales come from it), on the current stream, so where peers read rows
   one-sidedly (``remote_pushes``: the one-sided transports) one all-reduce of a flag follows on the
   same stream: every later gather (current stream, or the gather stream after ``rows_published``)
   comes after every owner's cast. On CUDA it is device-side, the host waits for nothing; on CPU
   (gloo) it is a host barrier. The collective transport needs none: a rank's all-gather sends its
   row when the rank calls it, after its own cast.
"""

from __future__ import annotations

import collections
import contextlib
import weakref

import torch

from . import Transport

#: sites whose pushes the current stream may run ahead of ([streams] 2): 1 is FSDP2's one reduce-scatter in flight;
#: None unbounded (``record_stream``)
PUSHES_IN_FLIGHT: int | None = 1


def _zero(tensors: list[torch.Tensor]) -> None:
    if tensors:  # one launch for all (torch's foreach ops refuse an empty list)
        torch._foreach_zero_(tensors)


def _hand_over(held: collections.deque, site: list, stream: torch.cuda.Stream) -> None:
    """Buffers held for bounded pushes (2) are freed like unbounded ones: once ``stream``'s work so far is done."""
    for _, buffers in held:
        for b in buffers:
            b.record_stream(stream)
    for b in site:
        b.record_stream(stream)
    held.clear()
    site.clear()


def _current(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    return torch.cuda.current_stream(stream.device)


class CommStreams:
    """The side streams (CUDA) gathers and pushes run on, and the events that order them (see [streams]).

    Args:
        transport: moves the rows.
        device: where the rows live (side streams on CUDA only).
        gather_ahead: give prefetches a side stream.
        push_aside: give pushes a side stream.
    """

    def __init__(self, transport: Transport, device: torch.device, gather_ahead: bool, push_aside: bool):
        self.transport = transport
        self.device = device
        cuda = device.type == "cuda"
        self.gather_stream = torch.cuda.Stream(device) if cuda and gather_ahead else None
        self.push_stream = torch.cuda.Stream(device) if cuda and push_aside else None
        # the zero flag whose all-reduce orders later one-sided pushes after every owner's zeroing (5)
        barrier = self.push_stream is not None and transport.caps.remote_pushes
        self._flag = torch.zeros(1, device=device) if barrier else None
        self.written_aside([self._flag] if self._flag is not None else [])
        self._row_flag: torch.Tensor | None = None  # the float8 cast's barrier (6), made on first use
        self.pushes_in_flight = PUSHES_IN_FLIGHT  # (2) settable per model: model.comm.pushes_in_flight
        # bounded pushes (2): the sites whose pushes the current stream has not waited for, each with the event after
        # its last push and the buffers they read, and the buffers of the site being pushed
        self._held: collections.deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = collections.deque()
        self._site: list[torch.Tensor] = []
        if self.push_stream is not None:  # a model dropped without close(): its held buffers wait for their pushes
            weakref.finalize(self, _hand_over, self._held, self._site, self.push_stream).atexit = False

    @staticmethod
    def _after_current(stream: torch.cuda.Stream | None):
        """Context running on ``stream`` after the work queued so far on the current stream (None: stay)."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(_current(stream))
        return torch.cuda.stream(stream)

    def gather(self, g: int, out: torch.Tensor, ahead: bool = False) -> torch.cuda.Event | None:
        """Fill ``out`` with group ``g``'s full values; ahead of use on the side stream, returning its event (1)."""
        stream = self.gather_stream if ahead else None
        with self._after_current(stream):
            self.transport.gather(g, out)
            if stream is None:
                return None
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the current stream wait for a gather queued ahead (nothing for None)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @property
    def pushes_in_flight(self) -> int | None:
        """Sites whose pushes the current stream may run ahead of (2): None unbounded, else an int >= 0."""
        return self._pushes_in_flight

    @pushes_in_flight.setter
    def pushes_in_flight(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"pushes_in_flight must be None (unbounded) or an int >= 0, got {value!r}")
        self._pushes_in_flight = value

    def push(self, g: int, grad: torch.Tensor) -> None:
        """Add ``grad`` into the owners' accumulator rows of group ``g``, on the push stream if there is one (2)."""
        with self._after_current(self.push_stream):
            self.transport.scatter_accumulate(g, grad)
        if self.push_stream is None:
            return
        if self._pushes_in_flight is None:
            grad.record_stream(self.push_stream)  # freed only once the push has read it
        else:
            self._site.append(grad)  # held until the current stream has waited for this site's pushes

    def site_pushed(self) -> None:
        """A site's groups are pushed (step 6): with bounded pushes, the current stream waits for the pushes of the
        site ``pushes_in_flight`` sites back, and their buffers go (2)."""
        if self.push_stream is None or self._pushes_in_flight is None or not self._site:
            return
        event = torch.cuda.Event()
        event.record(self.push_stream)
        self._held.append((event, list(self._site)))
        self._site.clear()
        while len(self._held) > self._pushes_in_flight:
            earlier, buffers = self._held.popleft()
            _current(self.push_stream).wait_event(earlier)
            del buffers  # after the wait is queued: a later allocation reusing a block runs after the push

    def held_bytes(self) -> int | None:
        """Bytes of the gradient buffers held for bounded pushes in flight (2): allocated until a later site's push
        waits for theirs. None where pushes are not held: no push stream, unbounded (their buffers count as free
        at once, [streams] 2), or bounded to 0 sites (each site's buffers go once its push is queued)."""
        if self.push_stream is None or not self._pushes_in_flight:
            return None
        return sum(b.nbytes for _, buffers in self._held for b in buffers) + sum(b.nbytes for b in self._site)

    def backward_done(self) -> None:
        """The end of a backward (step 7): buffers still held for bounded pushes are freed once their pushes are
        done, as unbounded ones are, instead of living into the next micro-batch (2)."""
        if self.push_stream is not None:
            _hand_over(self._held, self._site, self.push_stream)

    def pushes_done(self) -> None:
        """This rank's pushes are complete and visible to their owners (3)."""
        self._current_waits_for_side_streams()
        if self.push_stream is not None:
            self._held.clear()  # every push waited for: their buffers may go in stream order
            self._site.clear()
        self.transport.quiesce()

    def _current_waits_for_side_streams(self) -> None:
        # what quiesce completes (it waits for the current stream only): the pushes, and the gathers, so that no
        # read of a peer's rows outlives the meeting after which they change
        for side in (self.push_stream, self.gather_stream):
            if side is not None:
                _current(side).wait_stream(side)

    def written_aside(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` live as long as the model and the push stream writes them outside pushes (the zeroing, 5):
        freed, even by a model dropped without ``close()``, only once its work is done (heap views: no-op)."""
        if self.push_stream is not None:
            for t in tensors:
                t.record_stream(self.push_stream)

    def zero_before_meeting(self, accumulators: list[torch.Tensor]) -> None:
        """5, first half (every rank, right before a finish's or a change's meeting): without a push stream, zero
        this rank's ``accumulators`` now, which the meeting then orders before any rank's next push."""
        if self.push_stream is None:
            _zero(accumulators)

    def zero_after_meeting(self, accumulators: list[torch.Tensor], shard_group) -> None:
        """5, second half (every rank, right after that meeting and any late rows): with a push stream, zero
        ``accumulators`` on it after the current stream's work, then, where pushes are one-sided, the flag's
        all-reduce over ``shard_group`` (a ``RankGroup``), the device-side barrier every later push waits for."""
        if self.push_stream is None:
            return
        with self._after_current(self.push_stream):
            _zero(accumulators)
            if self._flag is not None:  # one-sided pushes: every rank's later pushes wait for every owner
                shard_group.all_reduce_sum(self._flag)  # completes once every rank's push stream has zeroed

    def late_rows_written(self, shard_group) -> None:
        """6 (every rank, after it wrote its late rows right after the meeting: the float8 cast): those rows are
        ordered before any peer's next gather."""
        if self.transport.caps.remote_pushes:  # the one-sided transports: peers read this rank's rows themselves
            if self._row_flag is None:
                self._row_flag = torch.zeros(1, device=self.device)
            shard_group.all_reduce_sum(self._row_flag)  # after every owner's cast (queued after it on CUDA)
        self.rows_published()

    def rows_published(self) -> None:
        """Rows written since the last meeting are visible to peers, and to later prefetches (4); pushes still in
        flight (a finish with no sync before it) are complete too."""
        self._current_waits_for_side_streams()
        self.transport.quiesce()
        if self.gather_stream is not None:
            self.gather_stream.wait_stream(_current(self.gather_stream))
