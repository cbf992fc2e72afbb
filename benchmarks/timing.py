"""How the benchmarks time GPU work: CUDA events around queued work on a GPU, the wall clock on CPU.

``elapsed_ms`` / ``timed`` time whole calls; ``Marks`` names points inside one (several spans of a step)."""

from __future__ import annotations

import time

import torch


def elapsed_ms(fn, cuda: bool, launches: int = 1) -> float:
    """Milliseconds that ``launches`` back-to-back calls of ``fn`` take.

    With ``cuda``: CUDA events on the current stream before the first call and after the last, then a wait for
    the second (the device's time for the queued work, not the host's). Otherwise the wall clock.
    """
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def timed(fn, iters: int, warmup: int = 0, cuda: bool = True) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` (``elapsed_ms``), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [elapsed_ms(fn, cuda) for _ in range(iters)]


class Marks:
    """Named points in the current stream's queue (CUDA events; the wall clock on CPU), read as milliseconds
    since the first after a wait for the last."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, object] = {}

    def mark(self, name: str) -> None:
        """Record point ``name`` now (in stream order on CUDA)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points[name] = ev
        else:
            self.points[name] = time.perf_counter()

    def read(self) -> dict[str, float]:
        """Every point's milliseconds since the first recorded one; clears them."""
        pts, self.points = self.points, {}
        first = next(iter(pts.values()))
        if self.cuda:
            torch.cuda.synchronize()
            return {k: first.elapsed_time(ev) for k, ev in pts.items()}
        return {k: (t - first) * 1e3 for k, t in pts.items()}


class StepEvents:
    """What the host did in a step beside the step's own work, for explaining an outlier: seconds in Python's
    garbage collector (``gc.callbacks``) and frames torch.compile compiled (dynamo's ``frames ok`` counter: a
    recompile after warm-up costs the host whole seconds). ``take()`` returns them since the last ``take()``."""

    def __init__(self):
        import gc

        self._gc_s, self._started = 0.0, None
        self._frames = self._compiled()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._gc_s += time.perf_counter() - self._started
            self._started = None

    @staticmethod
    def _compiled() -> int:
        try:
            from torch._dynamo.utils import counters
        except ImportError:  # a torch without dynamo compiles nothing
            return 0
        return counters["frames"]["ok"]

    def take(self) -> dict:
        """``{"gc_s": ..., "compiled_frames": ...}`` since the last call (or construction)."""
        frames = self._compiled()
        out = {"gc_s": self._gc_s, "compiled_frames": frames - self._frames}
        self._gc_s, self._frames = 0.0, frames
        return out

    def close(self) -> None:
        """Stop listening to the garbage collector."""
        import gc

        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
