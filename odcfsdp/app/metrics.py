"""Per-step metrics: a JSONL file (one object per step), TensorBoard when asked and installed, a progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


def json_safe(value):
    """``value`` with every non-finite float replaced by None: valid JSON (``NaN`` is not), nothing hidden.

    Rows with a non-finite loss or gradient norm carry ``"nonfinite": true`` as well.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """Writes ``metrics.jsonl`` under ``out_dir`` and, optionally, TensorBoard scalars.

    Lines are flushed as they are written, so a killed run keeps every finished step.
    """

    def __init__(self, out_dir: str | Path, tensorboard: bool = False, first_step: int = 1):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if first_step > 1 and self.path.is_file():  # a resumed run: keep the steps before it, drop any after
            kept = [line for line in self.path.read_text().splitlines()
                    if (row := _parse(line)) is not None and row["step"] < first_step]
            self.path.write_text("".join(line + "\n" for line in kept))
            self._file = self.path.open("a")
        else:
            self._file = self.path.open("w")
        self._tb = None
        self._failed = False
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:
                print("run.tensorboard=true but tensorboard is not installed; writing JSONL only", file=sys.stderr)

    def write(self, row: dict) -> None:
        try:
            self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: name the file (a bare "[Errno 28]" names nothing); earlier rows stay
            self._failed = True
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # the row that failed is still buffered; its error was raised already
            if not self._failed:
                raise
        if self._tb is not None:
            self._tb.close()


def _parse(line: str) -> dict | None:
    """One metrics row; None for a blank or torn line (a run killed while writing it)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (a torn last line is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    return [row for line in path.read_text().splitlines() if (row := _parse(line)) is not None]


class ProgressBar:
    """Progress on stderr: step, loss, throughput, MFU, ETA.

    On a terminal, one line redrawn in place (``\\r``); to a file or a pipe (a job's log), whole
    lines instead: the first and last step, every ``total // 20``-th, and every step with an
    ``eval_loss``, so a log reads line by line and stays short.
    """

    def __init__(self, total: int, width: int = 28, first_step: int = 1):
        self.total, self.width, self.start, self.first = total, width, time.perf_counter(), first_step
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 20)
        self.pending: dict | None = None

    def line(self, row: dict) -> str:
        """The progress text of ``row`` (without the bar on a file or pipe)."""
        done = row["step"] / self.total
        run_share = (row["step"] - self.first + 1) / (self.total - self.first + 1)
        filled = int(self.width * done)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / run_share - elapsed if run_share else 0.0
        mfu = f" mfu {row['mfu']:.1%}" if row.get("mfu") is not None else ""
        mfu += f" eval {row['eval_loss']:.4f}" if row.get("eval_loss") is not None else ""
        bar = f"[{'#' * filled}{'-' * (self.width - filled)}] " if self.tty else "step "
        loss = "nan" if row["loss"] is None else f"{row['loss']:.4f}"
        return f"{bar}{row['step']}/{self.total} loss {loss} {row['tokens_per_s']:.0f} tok/s{mfu} eta {eta:.0f}s"

    def update(self, row: dict) -> None:
        """Show ``row``'s step (redrawn on a terminal; a whole line at the steps a log keeps)."""
        self.pending = None
        if self.tty:
            print(f"\r{self.line(row)} ", end="", file=sys.stderr, flush=True)
        elif (row["step"] in (self.first, self.total) or row["step"] % self.every == 0
              or row.get("eval_loss") is not None):
            print(self.line(row), file=sys.stderr, flush=True)
        else:
            self.pending = row  # printed by close() if it is the last

    def close(self) -> None:
        """End the progress: a newline after a terminal's bar, or a log's last step if it was not shown."""
        if self.tty:
            print(file=sys.stderr)
        elif self.pending is not None:  # a run that stopped early: its last step
            print(self.line(self.pending), file=sys.stderr, flush=True)
