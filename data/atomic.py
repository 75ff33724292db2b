"""Atomic file replacement, so a crash never leaves a half-written file where a good one was."""
import os
import secrets
from contextlib import contextmanager


def fsync_path(p, strict=True):
    """fsync a file by path; ``strict=False`` for folders (best effort: some systems refuse)."""
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path`` to write; afterwards fsync it and
    rename it onto ``path``.  On any exception the temporary file is removed
    and ``path`` is left as it was."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)), strict=False)
