"""Atomic file replacement, so a crash never leaves a half-written file where a good one was."""
import os
import re
import secrets
from contextlib import contextmanager

# ``atomic_path``'s temporary files: "<name>.tmp-<pid>-<8 hex digits>", beside the file they replace
_TEMP = re.compile(r".+\.tmp-[0-9]+-[0-9a-f]{8}")


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
        if isinstance(e, OSError) and (e.filename == tmp or tmp in str(e)):
            why = os.strerror(e.errno) if e.filename == tmp and e.errno else str(e).replace(tmp, path)
            raise type(e)(f"cannot write {path}: {why}") from None
        raise
    fsync_path(folder, strict=False)
