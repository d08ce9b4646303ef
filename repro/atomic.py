"""Atomic file and directory writes: readers (resume checks, figures, other tools) never see a partial file.

Every write goes to a temporary sibling that is renamed into place. A temporary left behind by an exception is
removed by the writer; one left behind by SIGTERM is removed by a SIGTERM handler that this module installs
(once, from the main thread, the first time a write starts) and that then ends the process the way SIGTERM
would have (or hands the signal to the handler that was there before). A temporary's name holds the writer's host
and pid (`.<name>.<host>-<pid>-<random>`), so one left by a SIGKILLed writer is removed by the next write into the
same folder on that host once its process is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# temporary paths of writes in progress -> pid of the writing process (a forked child must not remove its parent's)
_live_temps: dict[str, int] = {}
_sigterm_installed = False
_atexit_registered = False


def _temp_prefix(path: Path, kind: str = "") -> str:
    """Prefix of a temporary sibling of `path` naming this host and process (see remove_dead_temps)."""
    return f".{path.name}.{kind}{socket.gethostname()}-{os.getpid()}-"


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a folder or temp naming it is then not a leftover)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_temps(path: Path) -> None:
    """Remove the temporaries left by killed writers of this host (their process is gone) in the folder of `path`:
    its own and those of every other output there (a killed import's hidden folder was removed only by a later
    import to the same --out). Those of live processes or other hosts (a shared file system) are left alone."""
    path, host = Path(path), socket.gethostname()
    temp = re.compile(rf"^\..+\.(?:old\.)?{re.escape(host)}-(\d+)-[^-]+$")  # .<name>.[old.]<host>-<pid>-<random>
    try:
        siblings = list(os.scandir(path.parent))
    except OSError:
        return
    for sibling in siblings:
        found = temp.match(sibling.name)
        if found and not process_alive(int(found.group(1))):
            if sibling.is_dir(follow_symlinks=False):
                shutil.rmtree(sibling.path, ignore_errors=True)
            else:
                Path(sibling.path).unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[Path], object], *, replace: bool = True) -> None:
    """Call write(tmp_path) on a temporary sibling of `path`, then rename it onto `path` with the permissions a
    plain open() would give it (mkstemp's temporary file is owner-only).

    replace=False never replaces a file at `path`, even one that another process created while we wrote: the
    temporary is published with link(), which fails with FileExistsError when `path` exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _install_sigterm_cleanup()
    remove_dead_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), dir=path.parent)
    _live_temps[tmp] = os.getpid()
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new_file(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _live_temps.pop(tmp, None)


def _publish_new_file(tmp: str, path: Path) -> None:
    """Give the finished temporary the name `path` unless something is there already (FileExistsError)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(path):  # a file system without hard links: check, then rename (a small race)
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_dir(path: Path, write_into_dir: Callable[[Path], object], *, replace: bool = False) -> bool:
    """Fill a fresh temporary sibling directory with write_into_dir(tmp_dir), then publish it at `path` in one rename.

    Returns True when our directory was published, False when an existing one was kept. What is at `path`:
    - nothing, or an empty directory: ours is renamed into place (True).
    - a non-empty directory (an earlier run, or a concurrent writer that published first):
      replace=False: first writer wins. When it is there before we start, write_into_dir is not even called;
      when it appears while we write, ours is deleted. Either way the existing one stays (False). This is what
      caches want: several processes may build the same entry and all end up reading one complete copy.
      replace=True: ours takes its place in one atomic swap (Linux renameat2 RENAME_EXCHANGE; on systems
      without it the old one is renamed aside first, so `path` is briefly absent), then the old one is deleted.
    - a file: the rename fails with OSError (NotADirectoryError).
    atomic_dir never looks inside what is at `path`: the caller checks, before calling, that it may replace or
    reuse it (e.g. that it is a directory this suite wrote), and refuses otherwise. Readers of `path` never see a
    partly written directory; a reader that opens several files in turn can see a replace happen between two
    opens, so such readers compare os.stat(path).st_ino before and after (repro.traces.read_trace does).
    The temporary directory is removed on an exception and on SIGTERM.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not replace and _non_empty_dir(path):
        return False
    _install_sigterm_cleanup()
    remove_dead_temps(path)
    tmp = tempfile.mkdtemp(prefix=_temp_prefix(path), dir=path.parent)
    _live_temps[tmp] = os.getpid()
    try:
        write_into_dir(Path(tmp))
        os.chmod(tmp, 0o777 & ~_umask())
        return _publish_dir(tmp, path, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours (failed or not needed) or, after a swap, the old directory
        _live_temps.pop(tmp, None)


def _publish_dir(tmp: str, path: Path, replace: bool) -> bool:
    while True:
        try:
            os.rename(tmp, path)  # atomic; succeeds when path is absent or an empty directory
            return True
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if not replace:
            return False
        swapped = _rename_exchange(tmp, path)
        if swapped is None:
            swapped = _rename_aside_then_in(tmp, path)
        if swapped:
            return True  # tmp now holds the old directory (swap) or nothing; the caller deletes it


def _rename_aside_then_in(tmp: str, path: Path) -> bool:
    """Replace without an atomic swap: move the old directory aside, rename ours in (path is briefly absent).
    False when another writer got in between (the caller tries again)."""
    aside = tempfile.mkdtemp(prefix=_temp_prefix(path, "old."), dir=path.parent)
    _live_temps[aside] = os.getpid()
    try:
        try:
            os.rename(path, aside)  # onto our empty directory: allowed
        except FileNotFoundError:
            return False
        try:
            os.rename(tmp, path)
            return True
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return False
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        _live_temps.pop(aside, None)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = None


def _rename_exchange(a: str, b: Path) -> bool | None:
    """Swap the paths a and b atomically: True when swapped, False when b vanished, None when unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):  # not Linux / glibc < 2.28
            _renameat2 = False
    if _renameat2 is False:
        return None
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):  # file system without RENAME_EXCHANGE
        return None
    raise OSError(err, os.strerror(err), str(b))


def _non_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _remove_live_temps() -> None:
    """Remove the temporaries of this process's unfinished writes (no lock: this can run inside a signal handler
    that interrupted a writer, and dict operations are atomic under the GIL)."""
    pid = os.getpid()
    for tmp, owner in list(_live_temps.items()):
        if owner == pid:
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            _live_temps.pop(tmp, None)


def _install_sigterm_cleanup() -> None:
    """Install (once, from the main thread: Python allows signal handlers only there) a SIGTERM handler that
    removes unfinished temporaries, then does what the previous handler would have done."""
    global _atexit_registered, _sigterm_installed
    if not _atexit_registered:  # a SystemExit in the main thread does not unwind a daemon thread's write
        _atexit_registered = True
        atexit.register(_remove_live_temps)
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN or previous is None:  # ignored on purpose, or set outside Python: leave it
        return

    def on_sigterm(signum, frame):
        if callable(previous):
            # a handler of the program's own (e.g. graceful shutdown): it decides; an exception it raises unwinds
            # the writers, whose cleanup removes their temporaries
            previous(signum, frame)
            return
        _remove_live_temps()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM as before (exit status 143 in a shell)

    signal.signal(signal.SIGTERM, on_sigterm)
