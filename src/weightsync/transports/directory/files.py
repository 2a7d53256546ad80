"""Files in a sync directory, opened as if an attacker had prepared them.

The directory transport trusts nothing it finds: the directory must belong to this user (or
root) and be writable by nobody else (as ssh requires of its keys); every file is opened with
``O_NOFOLLOW`` (a symlink is refused, never followed) and ``O_NONBLOCK`` and must be a regular
file (a FIFO cannot hang a call); files are created with ``mode`` (0600 by default) and the
directory, when weightsync creates it, with the matching directory mode (0700).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
import zlib
from pathlib import Path
from typing import Any

from weightsync.core.errors import IntegrityError, UnsafeDirectoryError, UnsafeFileError
from weightsync.core.liveness import pid_scope, process_dying

#: Mode of the files weightsync creates, unless the scheme is given another.
DEFAULT_FILE_MODE = 0o600
#: Control files (manifest, acks) are small; anything larger is refused unread.
MAX_CONTROL_BYTES = 16 << 20
#: A temp file of a writer in another pid namespace (whose pid cannot be judged here) is
#: removed as stale only when older than this (seconds): writing one takes milliseconds.
FOREIGN_TEMP_AGE_S = 600.0

_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def check_file_mode(mode: int) -> int:
    """``mode`` if it is a valid file mode the owner can read and write; ValueError otherwise."""
    if not isinstance(mode, int) or isinstance(mode, bool) or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError(
            f"mode must be a file mode such as 0o600 or 0o640 (owner read+write, no execute or "
            f"special bits), got {mode!r}"
        )
    return mode


def directory_mode(file_mode: int) -> int:
    """The directory mode matching a file mode: whoever may read a file may also list it."""
    return file_mode | ((file_mode & 0o444) >> 2)


def ensure_directory(path: Path, file_mode: int, *, create: bool) -> None:
    """Create ``path`` (with :func:`directory_mode`) if ``create`` and absent, then check it."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, directory_mode(file_mode))
        except FileExistsError:
            pass
        else:
            os.chmod(path, directory_mode(file_mode))  # the umask may have narrowed it
    check_directory(path, file_mode)


def check_directory(path: Path, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Refuse a directory another user owns or may write to (unless ``file_mode`` shares
    files with the group or others, which then may), and a symlink another user made."""
    me = os.geteuid()
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise UnsafeDirectoryError(
            f"{path} is a symbolic link owned by uid {link.st_uid}, not by this user "
            f"(uid {me}): refusing to follow it"
        )
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory")
    group_shared = bool(file_mode & 0o060)
    owner_ok = info.st_uid in (me, 0) or (
        group_shared and (info.st_gid == os.getegid() or info.st_gid in os.getgroups())
    )
    if not owner_ok:
        raise UnsafeDirectoryError(
            f"{path} is owned by uid {info.st_uid}, not by this user (uid {me}): another user "
            "could have prepared its files; use a directory of your own"
        )
    allowed = file_mode & 0o022  # write access the user asked to share
    extra = info.st_mode & 0o022 & ~allowed
    if extra:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002))
                           if extra & bit)
        raise UnsafeDirectoryError(
            f"{path} is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}): another user "
            f"could replace its files; run `chmod go-w {path}` or use a directory of your own"
        )


def open_regular(path: Path, flags: int, create_mode: int | None = None) -> int:
    """``os.open`` that never follows a symlink, never blocks on a FIFO, and accepts only a
    regular file (for which ``O_NONBLOCK`` changes nothing). With ``create_mode`` it creates
    the file (if absent) with exactly that mode."""
    flags |= _SAFE_FLAGS
    if create_mode is not None:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, create_mode if create_mode is not None else 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link: refused, never followed") from exc
        if exc.errno == errno.ENXIO:  # a FIFO opened write-only with no reader
            raise UnsafeFileError(f"{path} is not a regular file (a FIFO?): refused") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(
                f"{path} is not a regular file (mode {stat.filemode(info.st_mode)}): refused"
            )
        if create_mode is not None and info.st_uid == os.geteuid() and \
                stat.S_IMODE(info.st_mode) != create_mode:
            os.fchmod(fd, create_mode)  # the umask narrows, a pre-existing file may be wider
    except BaseException:
        os.close(fd)
        raise
    return fd


def _scope_tag() -> str:
    """A short name of this process's pid namespace (:func:`pid_scope`) for temp file names;
    ``x`` when unknown."""
    scope = pid_scope()
    return "x" if scope is None else f"{zlib.crc32(scope.encode()):08x}"


def create_temp(directory: Path, stem: str, mode: int) -> tuple[Path, int]:
    """A new, uniquely named temp file (``O_EXCL``) next to ``stem``, opened for writing; its
    name carries the writer's pid and pid namespace, so a cleanup can tell whether it may
    judge that pid (:func:`remove_stale_temp_files`)."""
    path = directory / f".{stem}.tmp-{os.getpid()}.{_scope_tag()}-{os.urandom(6).hex()}"
    fd = open_regular(path, os.O_RDWR | os.O_EXCL, create_mode=mode)
    return path, fd


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, *, mode: int, durable: bool = True) -> None:
    """Write a temp file, fsync it, rename it over ``path`` (which replaces a symlink there
    rather than following it), fsync the directory."""
    tmp, fd = create_temp(path.parent, path.name, mode)
    try:
        try:
            os.write(fd, json.dumps(obj, separators=(",", ":")).encode())
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(path.parent)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if absent; :class:`IntegrityError` naming the file
    for anything else (a symlink, a FIFO, too large, not JSON, nested too deep, not an object)."""
    found = read_json_if_changed(path, None)
    return None if found is None else found[1]


def read_json_if_changed(
    path: Path, known: bytes | None
) -> tuple[bytes, dict[str, Any] | None] | None:
    """Like :func:`read_json_object`, also returning the raw bytes; the object is None (not
    parsed again) when the bytes equal ``known``. None if the file is absent."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        raw = _read_small(fd, path)
    finally:
        os.close(fd)
    if raw == known:
        return raw, None
    return raw, _parse_json_object(path, raw)


def _read_small(fd: int, path: Path) -> bytes:
    """The whole content of a control file (at most :data:`MAX_CONTROL_BYTES`)."""
    size = os.fstat(fd).st_size
    if size > MAX_CONTROL_BYTES:
        raise IntegrityError(f"{path} is larger than {MAX_CONTROL_BYTES} bytes: refused unread")
    chunks = []
    while True:  # a file replaced by rename never changes under us; one read, usually
        chunk = os.read(fd, max(size + 1, 4096))
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        if sum(map(len, chunks)) > MAX_CONTROL_BYTES:
            raise IntegrityError(f"{path} grew past {MAX_CONTROL_BYTES} bytes: refused")
    return b"".join(chunks)


def _parse_json_object(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise IntegrityError(f"{path} is not valid JSON ({reason})") from None
    if not isinstance(obj, dict):
        raise IntegrityError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    return obj


def _temp_file_stale(writer: str, mtime: float) -> bool:
    """Whether a temp file whose name gives ``writer`` (``pid.tag``, or a bare pid from an
    older version) may be removed: its writer is dead, or, when the writer's pid is of
    another pid namespace and cannot be judged here, the file is older than
    :data:`FOREIGN_TEMP_AGE_S`."""
    pid, _, tag = writer.partition(".")
    if not pid.isdigit():
        return True
    if tag and (tag == "x" or tag != _scope_tag()):
        return time.time() - mtime > FOREIGN_TEMP_AGE_S
    return int(pid) == os.getpid() or process_dying(int(pid))


def remove_stale_temp_files(directory: Path) -> int:
    """Delete temp files that dead writers left behind (unlink never follows a symlink);
    a live process's temp file (a receiver writing its ack) is left alone."""
    removed = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(".") or ".tmp-" not in entry.name:
                continue
            writer = entry.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if not _temp_file_stale(writer, mtime):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
    return removed
