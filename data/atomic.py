"""Atomic file replacement, so a crash never leaves a half-written file where a good one was."""
import errno
import os
import re
import secrets
import shutil
from contextlib import contextmanager

# ``atomic_path``'s temporary files: "<name>.tmp-<pid>-<8 hex digits>", beside the file they replace
_TEMP = re.compile(r".+\.tmp-[0-9]+-[0-9a-f]{8}")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the errnos of a write that found no room


def _temp_path(path):
    """A fresh temporary name beside ``path`` (the writer's pid and a random tag: no two writers collide)."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temps(folder):
    """Remove the temporary files that a crash mid-write left in ``folder`` (our pattern only,
    nothing else); -> their names.  Only for a folder that no other process writes now."""
    removed = []
    with os.scandir(folder) as entries:
        stale = sorted(e.name for e in entries if _TEMP.fullmatch(e.name) and e.is_file(follow_symlinks=False))
    for name in stale:
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


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


def disk_full(path, code=errno.ENOSPC, detail=""):
    """The one-line OSError (errno ``code``) of a write of ``path`` that found no room: what happened,
    ``detail``, and whether the earlier ``path`` is kept (a user's next question), without a library's
    internals."""
    name = os.path.basename(path)
    kept = f"the earlier {name} is kept" if os.path.exists(path) else f"no earlier {name} to keep"
    e = OSError(f"{os.strerror(code).lower()} writing {path} ({detail + '; ' if detail else ''}{kept})")
    e.errno = code
    return e


@contextmanager
def atomic_path(path, size=0):
    """Yield a temporary path beside ``path`` to write; afterwards fsync it and
    rename it onto ``path``.  On any exception the temporary file is removed
    and ``path`` is left as it was.

    A missing folder is created first (as ``mkdir -p``: exporting to a new
    folder just works), and an error writing the temporary file names
    ``path``, the file the user asked for, not the temporary one.  ``size``:
    the bytes the file will take at least, where known: a disk without that
    much room is refused before anything is written (a library that runs out
    of room mid-file may fail again cleaning up, or crash: HDF5).  A full disk
    is one line (``disk_full``)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise type(e)(f"cannot write {path}: cannot create the folder {e.filename or folder} "
                      f"({e.strerror or e})") from None
    free = shutil.disk_usage(folder).free if size else 0
    if free < size:
        raise disk_full(path, detail=f"it needs {size / 1e6:.1f} MB, {free / 1e6:.1f} MB free")
    tmp = _temp_path(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise disk_full(path, e.errno, detail="the partial file is removed") from None
        if isinstance(e, OSError) and (e.filename == tmp or tmp in str(e)):
            why = os.strerror(e.errno) if e.errno else str(e).replace(tmp, path)
            raise type(e)(f"cannot write {path}: {why}") from None
        raise
    fsync_path(folder, strict=False)
