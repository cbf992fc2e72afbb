"""One run at a time in a run.out_dir (issue 44, item 1; [run-lock] in odcfsdp/checkpoint/lock.py): of processes that
lock one directory at the same instant exactly one holds it, a second run is refused in one line naming the holder
(exit code 2), a lock left by a killed run is taken over with a note, and every way out releases it. Subprocesses
with bounded time, exit codes asserted."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odcfsdp.checkpoint.lock import LOCK_FILE, DirLock, InUseError, _started_ticks
from odcfsdp.interrupts import _before_exit_now

from test_interrupts import finish, start, trained_steps, wait_for
from test_train import _alive, _ranks_of
from warm_cli import cli

IN_USE = re.compile(r"error: run\.out_dir='(?P<dir>[^']+)' is in use by run pid (?P<pid>\d+) \(started "
                    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): wait for it to end \(or stop it\), or choose another "
                    r"run\.out_dir")


def _lock_rounds(root: str, rounds: int, barrier, won) -> None:
    """One contender: at each round, after a barrier, lock that round's directory (held until the next barrier)."""
    for k in range(rounds):
        barrier.wait(timeout=60)
        lock = DirLock(Path(root) / f"round{k}")
        try:
            lock.acquire()
            won.put(k)
        except InUseError:
            pass
        barrier.wait(timeout=60)  # every contender has tried while the winner holds it
        lock.release()


def test_of_processes_that_lock_one_dir_at_the_same_instant_exactly_one_holds_it(tmp_path):
    ctx = mp.get_context("fork")
    rounds, contenders = 60, 3
    barrier, won = ctx.Barrier(contenders), ctx.Queue()
    procs = [ctx.Process(target=_lock_rounds, args=(str(tmp_path), rounds, barrier, won)) for _ in range(contenders)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * contenders
    winners = []
    while not won.empty():
        winners.append(won.get())
    assert sorted(winners) == list(range(rounds))  # one winner a round, never two, never none
    assert not list(tmp_path.glob(f"round*/{LOCK_FILE}"))  # released: the files are gone


def _critical_sections(root: str, tries: int, overlaps) -> None:
    """Lock and release one directory over and over; count a holder that finds another inside."""
    inside = Path(root) / "inside"
    for _ in range(tries):
        try:
            with DirLock(root):
                try:
                    fd = os.open(inside, os.O_CREAT | os.O_EXCL)  # another holder's marker: two holders at once
                    os.close(fd)
                except FileExistsError:
                    overlaps.put(1)
                    continue
                time.sleep(0.0005)
                inside.unlink()
        except InUseError:
            pass


def test_a_lock_released_while_another_process_opens_it_is_never_held_twice(tmp_path):
    """[run-lock] 3: the holder removes the file as it releases it; a process that opened the removed file and
    locks it must not count as a holder next to one that locked the new file."""
    ctx = mp.get_context("fork")
    overlaps = ctx.Queue()
    procs = [ctx.Process(target=_critical_sections, args=(str(tmp_path), 400, overlaps)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0] and overlaps.empty()


HOLD = """
import sys, time
from odcfsdp.checkpoint.lock import DirLock
lock = DirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_is_refused_naming_its_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(InUseError) as e:
            DirLock(tmp_path / "run").acquire()
        assert IN_USE.fullmatch(f"error: {e.value}") and f"run pid {holder.pid} (" in str(e.value), str(e.value)
    finally:
        holder.kill()
        holder.wait()
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())  # SIGKILL: the file stays, its lock does not
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    lock = DirLock(tmp_path / "run").acquire()
    try:
        assert lock.note == (f"note: run.out_dir='{tmp_path / 'run'}': run pid {holder.pid} (started "
                             f"{record['started']}) ended without releasing its lock (killed?); taken over")
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.release in _before_exit_now  # a second signal's os._exit releases it too
    finally:
        lock.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists() and lock.release not in _before_exit_now


def test_a_free_lock_whose_file_names_a_live_process_is_refused_a_reused_pid_is_not(tmp_path):
    """[run-lock] 2: the file, not only the kernel's lock, keeps a live holder's directory (a file system that lost
    its locks); a pid whose start time differs is another process (a reused pid) and is taken over."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = {"pid": sleeper.pid, "host": socket.gethostname(), "started": "2000-01-01 00:00:00",
                  "ticks": _started_ticks(sleeper.pid)}
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(InUseError, match=rf"is in use by run pid {sleeper.pid} \(started 2000-01-01 00:00:00\)"):
            DirLock(tmp_path).acquire()
        (tmp_path / LOCK_FILE).write_text(json.dumps({**record, "ticks": record["ticks"] - 1}))
        with DirLock(tmp_path) as lock:
            assert "ended without releasing its lock" in lock.note
    finally:
        sleeper.kill()
        sleeper.wait()


def _cli(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "odcfsdp.train", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_two_runs_started_at_the_same_instant_into_one_out_dir(tmp_path):
    """Both pass the pre-start checks (the directory is empty); exactly one trains, the other is refused in one line
    naming it (exit code 2); the first run's metrics and checkpoints are whole, and its lock is gone at its end."""
    args = ["run.steps=60", "run.world_size=1", "run.out_dir=X", "checkpoint.interval=10"]
    runs = [_cli(tmp_path, *args), _cli(tmp_path, *args)]
    errs = [finish(p, timeout=300) for p in runs]
    codes = sorted(p.returncode for p in runs)
    assert codes == [0, 2], [e[-2000:] for e in errs]
    (won, won_err), (lost, lost_err) = sorted(zip(runs, errs), key=lambda pe: pe[0].returncode)
    lines = lost_err.strip().splitlines()
    assert len(lines) == 1 and IN_USE.fullmatch(lines[0]), lost_err
    assert IN_USE.fullmatch(lines[0])["pid"] == str(won.pid) and IN_USE.fullmatch(lines[0])["dir"] == "X"
    assert "error:" not in won_err, won_err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "X" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))  # one run's lines, none interleaved
    assert sorted(p.name for p in (tmp_path / "X" / "checkpoints").iterdir()) == [
        "step_00000040", "step_00000050", "step_00000060"]
    assert not (tmp_path / "X" / LOCK_FILE).exists()


def test_a_killed_runs_lock_is_taken_over_and_sigterm_releases_it(tmp_path):
    """SIGKILL leaves the lock file (the kernel frees the lock): the next start resumes with a note naming the killed
    run; that run, stopped by SIGTERM, leaves no lock; and a checkpoint.dir outside run.out_dir is locked too."""
    common = ["checkpoint.interval=1", "checkpoint.dir=ck", "data.micro_batch_tokens=1024"]
    first = start(tmp_path, "run.steps=400", *common)
    wait_for(lambda: trained_steps(tmp_path) >= 2, first, "training")
    ranks = _ranks_of(first.pid)
    first.send_signal(signal.SIGKILL)
    finish(first)
    deadline = time.monotonic() + 20
    while any(_alive(r) for r in ranks):  # [launcher-link]: at once
        assert time.monotonic() < deadline, "the killed run's ranks live on"
        time.sleep(0.05)
    for d in ("run", "ck"):
        assert json.loads((tmp_path / d / LOCK_FILE).read_text())["pid"] == first.pid
    again = start(tmp_path, "run.steps=400", "checkpoint.resume=auto", *common)
    cut = trained_steps(tmp_path)
    wait_for(lambda: trained_steps(tmp_path) >= cut + 2, again, "training after the take-over")
    blocked = cli("run.out_dir=other", "checkpoint.dir=ck", "run.steps=2", cwd=tmp_path, timeout=120)
    again.send_signal(signal.SIGTERM)
    err = finish(again)
    assert again.returncode == 0, err[-2000:]
    notes = [line for line in err.splitlines() if "ended without releasing its lock" in line]
    assert [n.split(": ", 2)[1] for n in notes] == ["run.out_dir='run'", "checkpoint.dir='ck'"], err[-2000:]
    assert all(f"run pid {first.pid} (started " in n and n.endswith("(killed?); taken over") for n in notes)
    assert "terminated (SIGTERM) after step" in err and not list(tmp_path.glob(f"*/{LOCK_FILE}"))
    lines = blocked.stderr.strip().splitlines()
    assert blocked.returncode == 2 and len(lines) == 1, blocked.stderr[-2000:]
    assert lines[0].startswith(f"error: checkpoint.dir='ck' is in use by run pid {again.pid} (started ") and \
        lines[0].endswith("or choose another checkpoint.dir"), lines
    assert not (tmp_path / "other" / "metrics.jsonl").exists()


def test_a_checkpoint_dir_inside_another_runs_out_dir_is_refused(tmp_path):
    """A run's own checkpoint directory inside its run.out_dir is locked too: another run whose checkpoint.dir points
    there (its run.out_dir elsewhere) is refused in one line, exit code 2 (both ran, and moved each other's saves)."""
    first = start(tmp_path, "run.steps=400", "checkpoint.interval=1", "data.micro_batch_tokens=1024")
    wait_for(lambda: trained_steps(tmp_path) >= 1, first, "training")
    blocked = cli("run.out_dir=other", "checkpoint.dir=run/checkpoints", "run.steps=2", cwd=tmp_path, timeout=120)
    first.send_signal(signal.SIGTERM)
    err = finish(first)
    assert first.returncode == 0, err[-2000:]
    lines = blocked.stderr.strip().splitlines()
    assert blocked.returncode == 2 and len(lines) == 1, blocked.stderr[-2000:]
    assert lines[0].startswith(f"error: checkpoint.dir='run/checkpoints' is in use by run pid {first.pid} (started ")
    assert not (tmp_path / "other" / "metrics.jsonl").exists() and not list(tmp_path.glob(f"**/{LOCK_FILE}"))


def test_every_way_out_releases_the_lock(tmp_path):
    """An error (a non-finite loss: exit code 3), a Ctrl-C during start-up (130), a rank's failure (1: a damaged
    checkpoint to resume): the lock file is gone each time (success and SIGTERM: above)."""
    from odcfsdp.checkpoint import latest_checkpoint

    common = ["optim.lr=1e6", "run.steps=12", "checkpoint.interval=1"]
    stopped = cli("run.out_dir=run", *common, cwd=tmp_path, timeout=300)
    assert stopped.returncode == 3 and not (tmp_path / "run" / LOCK_FILE).exists(), stopped.stderr[-2000:]
    starting = _cli(tmp_path, "run.out_dir=starting", "data.pool_tokens=30000000")
    wait_for(lambda: len(_ranks_of(starting.pid)) == 2, starting, "two ranks")
    starting.send_signal(signal.SIGINT)
    err = finish(starting)
    assert starting.returncode == 130 and not (tmp_path / "starting" / LOCK_FILE).exists(), err[-2000:]
    file = latest_checkpoint(tmp_path / "run" / "checkpoints") / "rank00000.safetensors"
    file.write_bytes(file.read_bytes()[:-100] + bytes(100))  # same size, other values: the checksum fails
    failed = cli("run.out_dir=run", "checkpoint.resume=auto", *common, cwd=tmp_path, timeout=300)
    assert failed.returncode == 1 and "checksum mismatch" in failed.stderr, failed.stderr[-2000:]
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_under_torchrun_rank_0_locks_and_every_rank_is_refused(tmp_path):
    """Global rank 0 takes the lock and tells the others (they do not race for it): with the directory held, the
    ranks exit with code 2 at once (torchrun may end the others first), one of them printing the line; nothing is
    written there."""
    from odcfsdp.launch import free_port

    t0 = time.monotonic()
    with DirLock(tmp_path / "T"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "odcfsdp.train",
                               "run.out_dir=T", "run.steps=3"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"is in use by run pid {os.getpid()} (" in errors[0], proc.stderr[-3000:]
    # whichever rank torchrun saw end first (rank 1 may exit before rank 0), with the refusal's code
    assert re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n.*\n.*\n  rank      : \d \(local_rank: \d\)\n"
                     r"  exitcode  : 2 ", proc.stderr), proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60  # no rank waited for a peer that had left
    assert sorted(p.name for p in (tmp_path / "T").iterdir()) == []
