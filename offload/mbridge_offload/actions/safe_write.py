"""Write a user's file so that nothing is ever lost (docs/security.md).

An existing file is replaced only with ``overwrite``, and then backed up under a name no other file has (created
with ``O_EXCL``, so concurrent writers never share one); a read-only file, directory, device or FIFO is never
replaced; a symlink stays a symlink. The content goes to a pid-named temp file in the target's directory, is
fsynced, takes the old mode and replaces the target with one ``rename``. Any failure leaves the target as it was;
a ``kill -9`` cannot clean up, so each write first removes temp files whose writer is gone. No torch.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from mbridge_offload.config.errors import InputError


class WriteError(InputError):
    """A write that is refused or failed; nothing was changed."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse a directory fsync; the rename is still atomic
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resolve_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` must change: symlinks followed (the link itself is kept)."""
    return Path(os.path.realpath(path))


def check_replaceable(target: Path, overwrite: bool, what: str = "output") -> bool:
    """Whether ``target`` exists; WriteError without ``overwrite``, or when it is read-only or not a regular file."""
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        raise WriteError(f"{target}: exists and is not a regular file; nothing written", f"choose another {what}")
    if not info.st_mode & stat.S_IWUSR:
        raise WriteError(
            f"{target}: is read-only (mode {stat.S_IMODE(info.st_mode):04o}); nothing written",
            "make it writable (chmod u+w) if it should change, or choose another path",
        )
    if not overwrite:
        raise WriteError(
            f"{target}: exists; nothing written",
            "pass --force (MCP: overwrite=true) to replace it (a backup is kept), or choose another path",
        )
    return True


def make_backup(target: Path) -> Path:
    """Copy ``target`` to a new, unique ``NAME.bak[.N]`` beside it (mode kept, fsynced; WriteError leaves no part)."""
    data = target.read_bytes()
    mode = stat.S_IMODE(os.stat(target).st_mode)
    for n in range(10_000):
        candidate = target.with_name(f"{target.name}.bak" + (f".{n}" if n else ""))
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise WriteError(f"{candidate}: cannot create the backup ({exc.strerror}); nothing written") from None
        try:
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            candidate.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise WriteError(f"{candidate}: cannot write the backup ({exc.strerror}); nothing written") from None
            raise
        os.close(fd)
        return candidate
    raise WriteError(f"{target}: 10000 backups exist already; nothing written", "remove old .bak files")


TEMP_TAG = ".mbridge-offload."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_temps(directory: Path) -> list[Path]:
    """Remove (and return) the temp files a killed writer left in ``directory``: a ``kill -9`` runs no cleanup."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            name = entry.name
            if TEMP_TAG not in name or not name.endswith(".tmp"):
                continue
            pid_text = name.split(TEMP_TAG, 1)[1].split(".", 1)[0]
            if pid_text.isdigit() and not _alive(int(pid_text)):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry)
    return removed


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Replace (or create) ``path`` (a symlink's target) with ``data`` atomically: readers see old or new, never half.

    Returns the path written. Raises WriteError (directory missing or not writable, disk full); nothing changed then.
    """
    target = resolve_target(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    sweep_stale_temps(target.parent)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}{TEMP_TAG}{os.getpid()}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        hint = "create the directory first" if not target.parent.exists() else "choose a writable directory"
        raise WriteError(f"{target.parent}: cannot write there ({exc.strerror}); nothing written", hint) from None
    temp = Path(name)
    try:
        _write_all(fd, payload)
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(temp, target)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        temp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(f"{target}: write failed ({exc.strerror or exc}); nothing was changed") from None
        raise
    _fsync_dir(target.parent)
    return target
