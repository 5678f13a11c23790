"""Can a data path be read without hanging or a traceback? Checked before anything
reads it (by `posttrain validate` / `run` through recipes/preflight.py, and by the row
reader): a symlink loop made pathlib raise `RuntimeError`, and a FIFO (named pipe)
given as a data file made `validate` wait forever for a writer."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def data_path_problem(path: str | Path) -> str | None:
    """What stops `path` (a data file or folder) from being read, as one sentence naming
    it and the fix; None when it is a regular file or a folder. Reads no data: `os.stat`
    only, which never blocks on a FIFO."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (
                f"{path} is a symlink loop (a link that leads back to itself); point the "
                "link at the data file, or give the file's own path"
            )
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"{path} does not exist"
        return f"{path} cannot be read ({e.strerror}); check its permissions"
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    what = _KINDS.get(stat.S_IFMT(st.st_mode), "special file")
    return (
        f"{path} is {what}, not a regular file (reading it could wait forever for a "
        "writer); give the data as a regular file"
    )
