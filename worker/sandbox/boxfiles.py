"""The one door through which the worker takes a file a box may have written.

A box (a build, a kernel host) runs submitted code with write access to its folders: its staging
output, its scratch HOME/TMPDIR. Whatever it leaves there may be a link to a file of the worker's
(its 0600 credentials, the key that encrypts secrets at rest), a hard link, a FIFO that blocks the
first open for ever, a socket, a file of any size, or a regular file that the box swaps for a link
while the worker looks. The worker, which may hold rights the box does not, must never open such a
path the way it opens its own files. This module is the only code that does:

- the folder is opened once, as a directory, without following a link (`O_NOFOLLOW|O_DIRECTORY`);
- the name is resolved beneath that descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
  | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` where the kernel has it (Linux >= 5.6), else one
  component at a time with `O_NOFOLLOW` (`..`, `.` and absolute names refused before any open);
- always `O_NONBLOCK` (a FIFO's open returns at once instead of waiting for a writer) and
  `O_NOCTTY`;
- `fstat` on the opened descriptor (not the path: no window between check and use) must show a
  regular file with one link; then at most a bound is read, and a file that grows past it while
  it is read is refused, not cut;
- what is taken is copied into memory or into a file the worker creates (`O_EXCL|O_NOFOLLOW`, 0600)
  in a folder no box is shown, before anything else reads it.

Everything else refuses with `BoxFileRefused`, whose message says what was found and that it was
not read. tests/worker/sandbox/test_boxfiles.py covers each shape; the audit test
(tests/worker/sandbox/test_hostile_box.py) fails if any other code opens a path beneath a
folder a box was given to write (`box_folders`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import uuid
from pathlib import Path, PurePosixPath

_SYS_OPENAT2 = 437  # the same number on every architecture Linux added it for (5.6)
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_CHUNK = 1 << 20


class BoxFileRefused(Exception):
    """A file a box wrote that the worker will not take; the message says why."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_openat2_works: bool | None = None  # None: not tried yet; False: the kernel (or a seccomp filter) refuses it

# The folders boxes were given to write (worker.sandbox.popen registers them): the audit test
# checks that nothing but this module opens a path beneath one.
_box_folders: set[str] = set()
_box_folders_lock = threading.Lock()
_inside = threading.local()


def register_box_folder(folder: Path) -> None:
    with _box_folders_lock:
        _box_folders.add(os.path.abspath(folder))


def box_folders() -> frozenset[str]:
    with _box_folders_lock:
        return frozenset(_box_folders)


def inside_helper() -> bool:
    """Whether this thread is in one of this module's opens (for the audit hook of the tests)."""
    return getattr(_inside, "depth", 0) > 0


def _relative_parts(name: str | Path) -> list[str]:
    parts = PurePosixPath(str(name)).parts
    if not parts or PurePosixPath(str(name)).is_absolute() or any(p in ("..", ".", "") for p in parts):
        raise BoxFileRefused(f"{str(name)!r} is not a plain relative name inside the box's folder; not read")
    return list(parts)


def _openat2(dir_fd: int, name: str) -> int | None:
    """The descriptor, or None when openat2 is unavailable here (then the caller walks)."""
    global _openat2_works
    if _openat2_works is False:
        return None
    how = _OpenHow(flags=_FILE_FLAGS, mode=0,
                   resolve=_RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV)
    fd = _LIBC.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dir_fd), ctypes.c_char_p(os.fsencode(name)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        _openat2_works = True
        return fd
    code = ctypes.get_errno()
    # ENOSYS: an older kernel; EPERM/EINVAL: a seccomp profile (older Docker) or resolve flags it
    # does not know. Then the component walk, which gives the same guarantees, does the work.
    if code in (errno.ENOSYS, errno.EPERM, errno.EINVAL) and not _openat2_works:
        _openat2_works = False
        return None
    raise OSError(code, os.strerror(code), name)


def _walk_open(dir_fd: int, parts: list[str]) -> int:
    """`parts` opened beneath `dir_fd` one component at a time, never following a link."""
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def _describe(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return what
    return "not a regular file"


def open_file(folder: Path, name: str | Path) -> int | None:
    """A read-only descriptor on the regular, singly-linked file `name` beneath `folder`, or None
    when there is no such entry. BoxFileRefused for anything else (a link anywhere on the way, a
    FIFO, a socket, a device, a folder, a hard link). The caller closes the descriptor."""
    parts = _relative_parts(name)
    shown = "/".join(parts)
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        try:
            dir_fd = os.open(folder, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise BoxFileRefused(f"the box's folder {folder} could not be opened as a folder "
                                 f"({error.strerror}); {shown} not read") from None
        try:
            fd = _openat2(dir_fd, shown)
            if fd is None:
                fd = _walk_open(dir_fd, parts)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR, errno.EMLINK):
                raise BoxFileRefused(f"{shown} in the box's folder is or passes through a link; not read "
                                     "(submitted code may only leave plain files)") from None
            if error.errno == errno.ENXIO:  # what opening a socket (or a device with no driver) gives
                raise BoxFileRefused(f"{shown} in the box's folder is a socket or a special file; not read "
                                     "(submitted code may only leave plain files)") from None
            raise BoxFileRefused(f"{shown} in the box's folder could not be opened ({error.strerror}); "
                                 "not read") from None
        finally:
            os.close(dir_fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            what = _describe(info.st_mode) if not stat.S_ISREG(info.st_mode) else \
                f"a file with {info.st_nlink} hard links"
            raise BoxFileRefused(f"{shown} in the box's folder is {what}; not read "
                                 "(submitted code may only leave plain files)")
        return fd
    finally:
        _inside.depth -= 1


def _too_large(shown: str, max_bytes: int) -> BoxFileRefused:
    return BoxFileRefused(f"{shown} in the box's folder holds more than {max_bytes} bytes; not read")


def read_bytes(folder: Path, name: str | Path, *, max_bytes: int) -> bytes | None:
    """The whole of the box's file `name` beneath `folder` (None: absent), at most `max_bytes`:
    a larger file, or one that grows past the bound while it is read, is refused."""
    fd = open_file(folder, name)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise _too_large(str(name), max_bytes)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise _too_large(str(name), max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def copy_out(folder: Path, name: str | Path, destination: Path, *, max_bytes: int,
             exact_bytes: int | None = None) -> bool:
    """Copy the box's file `name` beneath `folder` to `destination`, a path in a folder no box is
    shown; False when there is no such file. The copy is written beside `destination` (created
    new, 0600, not through a link) and renamed onto it whole. `exact_bytes`: the size the file
    must have (a parameter file's layout fixes it); a file that is shorter or longer when copied,
    because the box changed it meanwhile, is refused."""
    fd = open_file(folder, name)
    if fd is None:
        return False
    limit = max_bytes if exact_bytes is None else exact_bytes
    partial = destination.with_name(f".{destination.name}.{uuid.uuid4().hex[:8]}.partial")
    out = None
    try:
        size = os.fstat(fd).st_size
        if exact_bytes is not None and size != exact_bytes:
            raise BoxFileRefused(f"{name} in the box's folder holds {size} bytes, not the {exact_bytes} expected; "
                                 "not read")
        if size > limit:
            raise _too_large(str(name), limit)
        out = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        copied = 0
        while copied <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - copied))
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
            copied += len(chunk)
        if copied > limit:
            raise _too_large(str(name), limit)
        if exact_bytes is not None and copied != exact_bytes:
            raise BoxFileRefused(f"{name} in the box's folder changed while it was read ({copied} of "
                                 f"{exact_bytes} bytes); not read")
        os.close(out)
        out = None
        os.replace(partial, destination)
        return True
    except BaseException:
        if out is not None:
            os.close(out)
        partial.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def read_text(folder: Path, name: str | Path, *, max_bytes: int) -> str | None:
    data = read_bytes(folder, name, max_bytes=max_bytes)
    return None if data is None else data.decode("utf-8", errors="replace")
