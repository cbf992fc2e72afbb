"""A temporary directory short enough for a Unix socket's path, for multiprocessing's fork server."""

from __future__ import annotations

import os
import tempfile
from multiprocessing import util

#: room in a Unix socket's path (107 bytes on Linux) left for multiprocessing's ``pymp-*/listener-*`` under the base
ROOM = 107 - len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def pin_multiprocessing_tempdir() -> str:
    """Fix the directory multiprocessing keeps for this process (its fork server's socket goes there): under
    ``/tmp`` when ``$TMPDIR`` is too long a path for the socket (a deep ``TMPDIR`` failed the start with ``OSError:
    AF_UNIX path too long``), else where it would be anyway. Returns it."""
    previous = tempfile.tempdir
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) > ROOM and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        tempfile.tempdir = "/tmp"
    try:
        return util.get_temp_dir()  # made once per process, then kept (and removed at exit) by multiprocessing
    finally:
        tempfile.tempdir = previous
