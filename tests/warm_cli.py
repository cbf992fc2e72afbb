"""``python -m odcfsdp.train`` and ``python script.py`` for tests, without paying their imports on every call.

Each call of the command line imports torch, Hydra and odcfsdp (about 3 s of CPU on CI's 2 cores) before it
does anything; the suite makes about a hundred calls. ``run_cli`` keeps, per test process, one server that
imported the command line once (``_serve``), and forks a child of it per call. The child is a real process, as
``subprocess.run([sys.executable, "-m", "odcfsdp.train", ...])``'s would be: the caller's working directory and
environment at the time of the call, its own stdout and stderr (captured, and read until every process that
holds them has closed them), the interpreter's signal dispositions, the command line's ``main()``, the
interpreter's exit (threads joined, exit functions run) and an exit status that is its own (``-N`` for a signal,
as ``subprocess`` gives it). Only the imports are shared, and the server runs nothing else (no torch op) before
it forks. ``run_script`` runs a Python file the same way (``python path``: ``runpy.run_path`` as ``__main__``,
so ranks it spawns import the file as a spawned process's would). A call that does not end in order (a timeout,
an alarm, Ctrl-C) kills its child and the server; the next call starts a new one. Tests that signal a run, or
watch its process tree, start it with ``subprocess`` themselves, as do tests whose environment must reach the
imports (``PYTHONPATH``, ``TMPDIR``: the server imported with its own).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SERVER = None
_LOCK = threading.Lock()


def _send(fd: int, obj) -> None:
    payload = pickle.dumps(obj)
    data = memoryview(struct.pack("<Q", len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _recv(fd: int, timeout: float | None = None):
    if timeout is not None and not select.select([fd], [], [], max(timeout, 0.0))[0]:
        raise TimeoutError
    head = _read_exactly(fd, 8)
    return pickle.loads(_read_exactly(fd, struct.unpack("<Q", head)[0]))


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the warm command-line server is gone")
        out += chunk
    return out


def _child(request: dict, proto: tuple[int, int], out_w: int, err_w: int) -> None:
    """The forked child: become ``python -m odcfsdp.train <args>`` (or ``python <script> <args>``) in the caller's
    directory and environment."""
    code = 1
    try:
        for fd in proto:
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # what the interpreter sets at start-up
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request.get("script")
        try:
            if script is None:
                sys.argv = [str(Path(sys.modules["odcfsdp.train"].__file__)), *request["args"]]
                sys.modules["odcfsdp.train"].main()
            else:  # as `python script`: its directory first on sys.path, its globals a fresh __main__
                import runpy

                # absolute: multiprocessing resolves a relative __main__ path against the server's start directory
                script = str(Path(request["cwd"], script).resolve())
                sys.argv = [script, *request["args"]]
                sys.path.insert(0, str(Path(script).parent))
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:  # as the interpreter ends on an uncaught one: by the signal
            code = -signal.SIGINT
        except BaseException:
            import traceback

            traceback.print_exc()
    finally:
        try:
            import atexit

            threading._shutdown()  # non-daemon threads joined, then the exit functions, as at the interpreter's exit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def _serve(path: list[str]) -> None:
    """The server: import the command line once, then per request fork a child, copy its stdout and stderr into
    the caller's files until every process holding them has closed them (as ``subprocess.run`` reads its pipes to
    the end), and report the child's exit status."""
    sys.path[:] = path
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # a stray print must not reach the protocol
    import odcfsdp.train  # noqa: F401  (imports torch, Hydra and the application)

    _send(proto_out, "ready")
    while True:
        try:
            request = _recv(proto_in)
        except EOFError:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            _child(request, (proto_in, proto_out), out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        _send(proto_out, pid)
        with open(request["stdout"], "wb") as out, open(request["stderr"], "wb") as err:
            sinks = {out_r: out, err_r: err}
            while sinks:
                for fd in select.select(list(sinks), [], [])[0]:
                    chunk = os.read(fd, 1 << 16)
                    if chunk:
                        sinks[fd].write(chunk)
                        sinks[fd].flush()
                    else:
                        os.close(fd)
                        del sinks[fd]
        _, status = os.waitpid(pid, 0)
        _send(proto_out, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _server() -> subprocess.Popen:
    global _SERVER
    if _SERVER is None or _SERVER.poll() is not None:
        code = (f"import sys; sys.path[:0] = {[str(Path(__file__).parent)]!r}; import warm_cli; "
                f"warm_cli._serve({sys.path!r})")
        _SERVER = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert _recv(_SERVER.stdout.fileno(), timeout=600) == "ready"
        except BaseException:
            _drop_server()
            raise
    return _SERVER


def _drop_server(child: int | None = None) -> None:
    """After a call that did not end in order (a timeout, pytest-timeout's alarm, Ctrl-C): kill its child and the
    server, whose replies are no longer in step; the next call starts a new one."""
    global _SERVER
    if child is not None and child > 0:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _SERVER is not None:
        _SERVER.kill()
        _SERVER.wait()
        _SERVER = None


def run_cli(args: list[str], cwd: Path | str, timeout: float = 600, env: dict | None = None,
            script: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m odcfsdp.train *args`` (``script``: ``python script *args``) in ``cwd``, as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout, env=env)`` would (``env`` None: this
    process's environment now), in a child of the warm server; raises ``subprocess.TimeoutExpired`` past ``timeout``."""
    command = [sys.executable, *(["-m", "odcfsdp.train"] if script is None else [script]), *args]
    with _LOCK, tempfile.TemporaryDirectory() as tmp:
        server = _server()
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        _send(server.stdin.fileno(), {"args": list(args), "cwd": str(cwd), "script": script,
                                      "env": dict(os.environ if env is None else env),
                                      "stdout": str(out), "stderr": str(err)})
        pid = None
        try:
            pid = _recv(server.stdout.fileno(), timeout=60)
            code = _recv(server.stdout.fileno(), timeout=timeout)
        except TimeoutError:
            _drop_server(pid)
            raise subprocess.TimeoutExpired(command, timeout,
                                            out.read_text(errors="replace"), err.read_text(errors="replace"))
        except BaseException:
            _drop_server(pid)
            raise
        return subprocess.CompletedProcess(command, code,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))


def cli(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m odcfsdp.train *args`` in ``cwd`` (with ``env``: else this process's environment), its output
    captured, within ``timeout`` seconds: ``run_cli``, a process of its own forked from the warm server."""
    return run_cli(list(args), cwd=cwd, timeout=timeout, env=env)


def run_script(path: Path | str, *args: str, cwd: Path, timeout: float = 600, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """``python path *args`` in ``cwd``, its output captured, within ``timeout`` seconds: a process of its own forked
    from the warm server (``run_cli``), for scripts that need no interpreter of their own."""
    return run_cli(list(args), cwd=cwd, timeout=timeout, env=env, script=str(path))


def cold_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cli`` in a new interpreter, as a user runs it (imports included)."""
    return subprocess.run([sys.executable, "-m", "odcfsdp.train", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
