"""Putting a complete new checkpoint directory in place of the old one, all or nothing.

A save never edits `directory` file by file, so a process killed at any instant leaves the old
checkpoint or the new one, each complete, never a mix:

1. write the new shards, config and index into `.<name>.tmp-<id>` beside it;
2. hard-link (or copy) into it the old checkpoint's files the save does not replace (tokenizer
   files...; not old weight files), then fsync it;
3. swap: Linux `renameat2(RENAME_EXCHANGE)` exchanges the two directories atomically (the old one
   now at `.<name>.tmp-<id>`). Where it is missing, `directory` is renamed to `.<name>.old-<id>`,
   then the new one renamed in; in between, `current` reads the complete old one from there and
   the next save swaps from it. A new `directory` is a plain rename;
4. delete the old one and every `.<name>.tmp-<32 hex>` / `.<name>.old-<32 hex>` left by killed saves.

Invariants: a `.tmp-*` is never needed; an `.old-*` is always complete (renamed to a `.tmp-*` name
before it is deleted). One save per directory at a time: a save deletes any other's temporaries.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import uuid
from pathlib import Path

from .layout import is_weight_file
from ..errors import CheckpointError

__all__ = ["temporary", "current", "install", "fsync"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _target(directory: Path) -> Path:
    """The real path swapped: a symlinked checkpoint directory keeps its link."""
    return Path(os.path.realpath(directory))


def temporary(directory: Path, save_id: str) -> Path:
    """Where a save with id `save_id` (32 hex digits) writes the new checkpoint: beside `directory`."""
    target = _target(directory)
    return target.parent / f".{target.name}.tmp-{save_id}"


def _siblings(target: Path, kind: str) -> list[Path]:
    pattern = re.compile(rf"\.{re.escape(target.name)}\.{kind}-[0-9a-f]{{32}}")
    try:
        return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name))
    except FileNotFoundError:
        return []


def current(directory: Path) -> Path:
    """The directory holding the checkpoint now: `directory`, or, when a save was killed between moving
    it aside and moving the new one in, the complete old one beside it.

    Raises:
        ValueError: `directory` is missing and more than one old checkpoint is beside it.
    """
    target = _target(directory)
    if os.path.lexists(target):
        return Path(directory)
    olds = _siblings(target, "old")
    if len(olds) > 1:
        raise CheckpointError(f"{directory} is missing and {len(olds)} saves were interrupted while replacing it: "
                              f"{', '.join(p.name for p in olds)} each hold a complete older checkpoint; "
                              f"rename the one to use to {target.name}")
    return olds[0] if olds else Path(directory)


def install(new: Path, directory: Path, save_id: str) -> None:
    """Make the complete checkpoint in `new` (from `temporary`) the one in `directory`.

    Files of the current checkpoint that `new` lacks and that are not weight files are
    carried over. Safe to kill at any instant (see the module docstring).
    """
    target, source = _target(directory), current(directory)
    if source.is_dir():
        _carry(source, new)
    _sync(new)
    if not os.path.lexists(target):
        os.rename(new, target)  # a first save, or one recovering from an interrupted fallback swap
    elif not _exchange(new, target):
        aside = target.parent / f".{target.name}.old-{save_id}"
        os.rename(target, aside)
        try:
            os.rename(new, target)
        except OSError:
            os.rename(aside, target)
            raise
    _sync_dir(target.parent)
    for path in _siblings(target, "old") + _siblings(target, "tmp"):
        if path.name.startswith(f".{target.name}.old-"):
            trash = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
            os.rename(path, trash)  # an .old-* name only ever holds a complete checkpoint
            path = trash
        shutil.rmtree(path, ignore_errors=True)


def _carry(source: Path, new: Path) -> None:
    for path in sorted(source.iterdir()):
        dst = new / path.name
        if os.path.lexists(dst) or is_weight_file(path.name):
            continue
        if path.is_symlink():
            os.symlink(os.readlink(path), dst)
        elif path.is_dir():
            shutil.copytree(path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(path, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def fsync(path: Path) -> None:
    """Flush the file or directory `path` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(new: Path) -> None:
    """Flush the new files to disk before the swap makes them the checkpoint (power loss)."""
    for path in new.iterdir():
        if path.is_file() and not path.is_symlink():
            fsync(path)
    _sync_dir(new)


def _sync_dir(path: Path) -> None:
    try:
        fsync(path)
    except OSError:
        pass  # some file systems cannot fsync a directory


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # not Linux, or a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two existing paths; False, with nothing changed, where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # this kernel or file system cannot
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
