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
    and ``path`` is left as it was.

    A missing folder is created first (as ``mkdir -p``: exporting to a new
    folder just works), and an error writing the temporary file names
    ``path``, the file the user asked for, not the temporary one."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise type(e)(f"cannot write {path}: cannot create the folder {e.filename or folder} "
                      f"({e.strerror or e})") from None
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and (e.filename == tmp or tmp in str(e)):
            why = os.strerror(e.errno) if e.filename == tmp and e.errno else str(e).replace(tmp, path)
            raise type(e)(f"cannot write {path}: {why}") from None
        raise
    fsync_path(folder, strict=False)
