"""Training entry point: ``python -m odcfsdp.train [key=value ...]`` (Hydra; see ``odcfsdp/app/config.py``).

With no arguments it trains a tiny Llama on long-tailed synthetic SFT data with 2
CPU ranks that it starts itself (gloo + the shm transport), prints a progress bar
and writes ``runs/default/metrics.jsonl``. Under ``torchrun`` it uses the ranks
torchrun started (NCCL + nvshmem on GPUs).

This module is the command line and the ranks: Hydra's main, configuration errors
as one line (exit code 2; ``odcfsdp.app.cli`` checks the keys, [cli-keys]), starting ranks
(torchrun's, or spawned locally) and reporting their failures (1). The run itself is
``odcfsdp.app.trainer.train``; its pieces come from ``odcfsdp.app.builders``.

Interrupts: SIGTERM, SIGHUP (the terminal closed; not under ``nohup``) or a first Ctrl-C (SIGINT)
during the run make every rank finish its step and save a checkpoint, one line says so, exit code 0
(continue with ``checkpoint.resume=auto``); before the ranks train (start-up) there is nothing to
save: one line and exit code 128 + the signal's number (143, 129, 130). A second Ctrl-C ends at once (130).

One run at a time in a ``run.out_dir``: before any rank starts, the launching process (under
torchrun: global rank 0, which tells the others) takes the directory's lock ([run-lock] in
``odcfsdp/checkpoint/lock.py``), and a ``checkpoint.dir`` outside it too, makes the run-dir check
again under it, removes the leftovers of unfinished saves (``odcfsdp/checkpoint/sweep.py``), and
releases it however the run ends. A second run is refused in one line, exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

if __name__ == "__main__":  # the command line: a signal while torch and Hydra load ends with one line
    from odcfsdp.interrupts import exit_during_imports, install

    install(exit_during_imports)

import hydra
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from .cli import check_given, check_overrides, given_keys, help_text
from .config import TrainConfig, checkpoint_dir, config_from, register, resolve, validate
from ..checkpoint.lock import DirLock
from ..checkpoint.sweep import sweep_leftovers, sweep_note
from ..interrupts import Interrupted, exit_after_stop, install, leave_hung_up_terminal, raise_interrupted, stop_signals
from ..launch.processes import init_torchrun, spawn
from .preflight import check_run_dir, preflight
from .trainer import NonFiniteError, train

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


class RankError(RuntimeError):
    """A spawned rank failed; the message is one line naming the rank (the traceback goes to the run dir)."""


class StartRefused(Exception):
    """The run's directories are another run's, or became a used run's since the pre-start checks ([run-lock]); the
    message is one line naming the fix (exit code 2, as for a failed pre-start check)."""


def _train_worker(cfg_dict: dict) -> list[dict] | NonFiniteError:
    """One spawned rank: ``train`` the config; a ``NonFiniteError`` is returned to the parent, not raised."""
    try:
        return train(config_from(cfg_dict))
    except NonFiniteError as e:  # every rank stops at the same step: hand the parent the message, not a traceback
        return e


def _write_report(out_dir: Path, report: str, name: str = "error.log") -> str:
    """Write a failure's whole report (the ranks' tracebacks and stacks) to ``out_dir/name``, else, where that
    cannot be written (the disk that filled up and failed the run), to a temporary file; says where it went."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(report)
        return f"traceback in {out_dir / name}"
    except OSError as e:
        with contextlib.suppress(OSError):  # a partial report would pass for the whole one
            (out_dir / name).unlink(missing_ok=True)
        try:
            with tempfile.NamedTemporaryFile("w", prefix="odcfsdp-error-", suffix=".log", delete=False) as f:
                f.write(report)
            return f"traceback in {f.name}: {out_dir / name} could not be written ({e.strerror or e})"
        except OSError:
            return f"no traceback written: {out_dir / name}: {e.strerror or e}"


def _failed_line(report: str, where: str) -> str:
    """The one line a failed rank's report comes to: its first line and its exception's, and where the rest is."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    head = lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
    return f"{head} ({where})"


def _train_here(cfg: TrainConfig, rank: int) -> None:
    """Train in this process (``run.world_size=1``, or a rank torchrun started) with the error path of spawned ranks:
    a failure is one line, its traceback in ``error.log`` (``error.rank<r>.log`` for a rank other than 0)."""
    try:
        train(cfg)
    except Exception as e:  # noqa: BLE001 - every failure is reported alike (signals are BaseExceptions: not here)
        if isinstance(e, (NonFiniteError, StartRefused)):
            raise
        report = f"rank {rank} failed:\n{traceback.format_exc()}"
        where = _write_report(Path(cfg.run.out_dir), report, "error.log" if rank == 0 else f"error.rank{rank}.log")
        raise RankError(_failed_line(report, where)) from None


def _lock_run_dirs(cfg: TrainConfig) -> list[DirLock]:
    """Lock ``run.out_dir`` and a ``checkpoint.dir`` outside it ([run-lock]), check the run dir again under the
    lock, and sweep the checkpoints' leftovers; print the notes. ``ValueError`` (one line) where it is refused,
    with nothing held."""
    out_dir, ck_dir = Path(cfg.run.out_dir), checkpoint_dir(cfg)
    dirs = [("run.out_dir", out_dir)]
    if ck_dir.resolve() != out_dir.resolve():  # its own lock, even inside run.out_dir: another run's checkpoint.dir
        dirs.append(("checkpoint.dir", ck_dir))  # may point there, and two runs would move and prune each other's saves
    locks: list[DirLock] = []
    try:
        for key, path in dirs:
            locks.append(DirLock(path, key).acquire())
        check_run_dir(cfg)  # the pre-start check again: a run may have ended here since
        resumed = cfg.checkpoint.resume if cfg.checkpoint.resume not in ("none", "auto") else None
        notes = [lock.note for lock in locks] + [sweep_note(ck_dir, sweep_leftovers(ck_dir, keep=resumed))]
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        raise
    for note in notes:
        if note:
            print(note, file=sys.stderr)
    return locks


@contextlib.contextmanager
def _holding_run_dirs(cfg: TrainConfig, torchrun: bool):
    """The run's directories locked for the block ([run-lock]): by this process, or under torchrun by global rank 0,
    whose verdict the others wait for (they never race for the lock). Released however the block ends;
    ``StartRefused`` on every rank where another run holds them."""
    locks, refusal = [], None
    try:
        if not torchrun or dist.get_rank() == 0:
            try:
                locks = _lock_run_dirs(cfg)
            except ValueError as e:
                refusal = str(e)
            except Exception as e:  # noqa: BLE001 - under torchrun the others wait for this verdict: give them one
                if not torchrun:
                    raise
                refusal = f"run.out_dir={cfg.run.out_dir!r} could not be locked: {e}"
        if torchrun:
            verdict = [refusal]
            dist.broadcast_object_list(verdict, src=0)
            refusal = verdict[0]
        if refusal:
            raise StartRefused(refusal)
        yield
    finally:
        for lock in reversed(locks):
            lock.release()


def run(cfg: TrainConfig) -> None:
    """Start ranks as needed (torchrun's, or spawned locally) and train, holding the run's directories ([run-lock])."""
    validate(cfg)
    torchrun = "RANK" in os.environ  # started by torchrun
    if torchrun:
        init_torchrun(use_cuda=cfg.run.device != "cpu" and torch.cuda.is_available())
    try:
        with _holding_run_dirs(cfg, torchrun):
            if torchrun or cfg.run.world_size <= 1:
                _train_here(cfg, dist.get_rank() if torchrun else 0)
            else:
                _spawn_ranks(cfg)
    finally:
        if torchrun:
            dist.destroy_process_group()


def _spawn_ranks(cfg: TrainConfig) -> None:
    """Train on ``run.world_size`` ranks spawned here, passing the stop signals on; a failed rank is one line."""
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    received: list[int] = []
    try:
        results = spawn(_train_worker, cfg.run.world_size, OmegaConf.to_container(OmegaConf.structured(cfg)),
                        backend="nccl" if cuda else "gloo", timeout=7 * 24 * 3600,
                        forward=stop_signals(), received=received)
        # the ranks are done; a signal now finds a run that only has to exit (again, if it was interrupted); a
        # hang-up has nothing left to stop (a closed terminal may send two)
        install(exit_after_stop if received else signal.SIG_IGN)
        install(signal.SIG_IGN, (signal.SIGHUP,))
    except RuntimeError as e:  # a rank failed: one line here, the whole report in the run dir
        where = _write_report(Path(cfg.run.out_dir), "\n".join([str(e), *getattr(e, "__notes__", [])]))
        raise RankError(_failed_line(str(e), where)) from None
    except OSError as e:  # the ranks could not be started (no process, no socket): one line too
        where = _write_report(Path(cfg.run.out_dir), traceback.format_exc())
        raise RankError(f"could not start the ranks: {e} ({where})") from None
    finally:
        if signal.SIGHUP in received:  # the lines that follow must not fail on a closed terminal
            leave_hung_up_terminal()
    if isinstance(results[0], NonFiniteError):
        raise results[0]


def _multirun_job_dir(cfg: TrainConfig) -> None:
    """Under ``--multirun``, a job without its own ``run.out_dir`` override writes to its Hydra job directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    if not any(o.split("=")[0].lstrip("+~") == "run.out_dir" for o in hc.overrides.task):
        cfg.run.out_dir = hc.runtime.output_dir
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"job {hc.job.num} ({' '.join(hc.overrides.task) or 'defaults'}) -> {cfg.run.out_dir}", file=sys.stderr)


@hydra.main(version_base="1.3", config_name="train", config_path=None)
def _hydra_main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = resolve(OmegaConf.to_object(cfg))
    _multirun_job_dir(cfg)
    try:
        validate(cfg)
        notes = check_given(cfg, given_keys(list(HydraConfig.get().overrides.task)))
        notes += preflight(cfg, torchrun="RANK" in os.environ)
    except ValueError as e:  # a configuration error: one clear line, no traceback (under torchrun: one per node,
        if os.environ.get("LOCAL_RANK", "0") == "0":  # whose ranks all read the same files and refuse alike)
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            print(note, file=sys.stderr)
    try:
        run(cfg)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except RankError as e:
        print(f"\nerror: {e}", file=sys.stderr)  # after a progress bar that may be mid-line
        sys.exit(1)
    except StartRefused as e:  # another run holds run.out_dir: refused as a pre-start check is, before any rank
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """Console-script entry point (``odcfsdp-train``)."""
    install(raise_interrupted)  # one line, not a traceback, until the ranks take over
    try:
        _main(sys.argv[1:])
    except Interrupted as e:  # before the ranks trained, or a second Ctrl-C: exit 128 + the signal's number
        print(f"{chr(10) if sys.stderr.isatty() else ''}{e.message()}", file=sys.stderr)  # a bar may be mid-line
        sys.exit(e.exit_code)
    except BrokenPipeError:  # stdout's reader is gone (``--help | head``): end quietly, as SIGPIPE ends a tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        sys.exit(128 + signal.SIGPIPE)


def _main(args: list[str]) -> None:
    register()
    if "--help" in args or "-h" in args:
        print(help_text(CONFIGS_DIR))
        return
    try:
        args = check_overrides(args, groups=tuple(p.name for p in CONFIGS_DIR.iterdir() if p.is_dir())
                               if CONFIGS_DIR.is_dir() else ())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    defaults = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                "hydra/hydra_logging=disabled"]
    if CONFIGS_DIR.is_dir():  # source checkout: experiment presets under configs/
        defaults.append(f"hydra.searchpath=[file://{CONFIGS_DIR}]")
    given = {a.split("=")[0] for a in args}
    extra = [d for d in defaults if d.split("=")[0] not in given]
    # Hydra wants the overrides contiguous: put ours right before the user's first one.
    first = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    sys.argv[1:] = args[:first] + extra + args[first:]
    _hydra_main()


if __name__ == "__main__":
    main()
