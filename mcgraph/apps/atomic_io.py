"""State on disk, written atomically and read safely: the one helper every writer of state uses.

A write goes to a temporary file in the destination's directory, is flushed and ``fsync``-ed,
then :func:`os.replace`-d over the destination, and the directory is ``fsync``-ed so the new
name survives a power cut. At every moment the destination is either the previous complete
file or the new complete file, never a torn one; a process killed mid-write leaves at most a
stray ``.<name>.*.tmp`` beside it (removed by the next write that fails, ignored otherwise).

Checkpoints (:func:`save_checkpoint`) may keep the last ``keep`` previous versions as
``<name>.1`` (newest) … ``<name>.K``; :func:`load_checkpoint` reads with
``torch.load(weights_only=True)`` and turns every failure into a :class:`CheckpointError`
that names the file and what is wrong (missing, torn, not a torch file, carrying objects
other than tensors and plain data), and with ``fallback=True`` goes on to the previous
versions.

Test hooks (environment variables, read at each write; fault-injection tests use them):

* ``MCGRAPH_ATOMIC_PAUSE_S=<seconds>``: after the temporary file is complete and synced and
  before ``os.replace``, print ``mcgraph-atomic: paused before replacing <path>`` on stderr
  and sleep (a kill then lands inside the write);
* ``MCGRAPH_ATOMIC_FAIL=<ENOSPC|EACCES|EIO|…>``: raise that ``OSError`` while writing the
  temporary file (disk full, permission denied);
* ``MCGRAPH_ATOMIC_MATCH=<text>``: apply the two hooks above only to paths containing it.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_json(d / "row.json", {"a": 1})
    >>> read_json(d / "row.json")
    {'a': 1}
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["AtomicWriteError", "CheckpointError", "atomic_write", "write_bytes", "write_text", "write_json",
           "append_line", "read_json", "save_checkpoint", "load_checkpoint", "previous_versions"]


class AtomicWriteError(OSError):
    """An atomic write failed; the destination (named in the message) still holds its previous content."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be used; the message names the file and what is wrong with it."""

    def __init__(self, path, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): the rename is as durable as it gets
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _hooks_apply(path: Path) -> bool:
    match = os.environ.get("MCGRAPH_ATOMIC_MATCH")
    return not match or match in str(path)


def _fail_hook(path: Path) -> None:
    name = os.environ.get("MCGRAPH_ATOMIC_FAIL")
    if name and _hooks_apply(path):
        code = getattr(errno, name, errno.EIO)
        raise OSError(code, os.strerror(code), str(path))


def _pause_hook(path: Path) -> None:
    seconds = os.environ.get("MCGRAPH_ATOMIC_PAUSE_S")
    if seconds and _hooks_apply(path):
        print(f"mcgraph-atomic: paused before replacing {path}", file=sys.stderr, flush=True)
        time.sleep(float(seconds))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, keep: int = 0, encoding: str | None = None
                 ) -> Iterator[io.IOBase]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path``.

    Args:
        path: the destination; its directory must exist.
        mode: ``"wb"`` or ``"w"`` (text, ``encoding`` default UTF-8).
        keep: keep this many previous versions of ``path`` as ``path.1`` (newest) … ``path.keep``;
            they are rotated only once the new file is complete, and ``path`` itself is never absent.

    Raises:
        AtomicWriteError: the write failed (disk full, permission denied, …); ``path`` is untouched and
            the message names it.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be an int >= 0, got {keep!r}")
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise AtomicWriteError(e.errno, f"cannot write {path}: {e.strerror or e}", str(path)) from e
    tmp = Path(tmp)
    try:
        with os.fdopen(fd, mode, **({"encoding": encoding or "utf-8", "newline": ""} if mode == "w" else {})) as f:
            _fail_hook(path)
            yield f
            f.flush()
            os.fsync(f.fileno())
        _pause_hook(path)
        if keep and path.exists():
            _rotate(path, keep)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, AtomicWriteError):
            raise AtomicWriteError(e.errno, f"cannot write {path}: {e.strerror or e}; the previous "
                                   f"content of {path} is unchanged", str(path)) from e
        raise
    _fsync_dir(directory)


def _rotate(path: Path, keep: int) -> None:
    """``path.{k}`` → ``path.{k+1}`` (dropping ``path.keep``), then ``path`` → ``path.1`` by a hard link, so
    ``path`` stays in place until the caller replaces it."""
    for k in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{k}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{k + 1}"))
    link = path.with_name(f".{path.name}.link.tmp")
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    try:
        os.link(path, link)
    except OSError:  # no hard links here: copy (still atomically)
        with atomic_write(path.with_name(f"{path.name}.1")) as f, open(path, "rb") as src:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        return
    os.replace(link, path.with_name(f"{path.name}.1"))


def previous_versions(path: str | os.PathLike) -> list[Path]:
    """The kept previous versions of ``path`` that exist, newest first (``path.1``, ``path.2``, …)."""
    path = Path(path)
    out, k = [], 1
    while (p := path.with_name(f"{path.name}.{k}")).exists():
        out.append(p)
        k += 1
    return out


def write_bytes(path: str | os.PathLike, data: bytes, *, keep: int = 0) -> None:
    """Atomically write ``data`` to ``path``."""
    with atomic_write(path, "wb", keep=keep) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, keep: int = 0) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_write(path, "w", keep=keep) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs) -> None:
    """Atomically write ``json.dumps(obj, **dumps_kwargs)`` to ``path``."""
    write_text(path, json.dumps(obj, **dumps_kwargs))


def append_line(path: str | os.PathLike, line: str) -> None:
    """Atomically append one line to the text file ``path`` (the whole file is rewritten: for the small
    logs and row files a resume or a report reads, where a torn last line would break the reader)."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    write_text(path, old + line.rstrip("\n") + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """``json.loads`` of ``path``; a file that is not valid JSON raises ``ValueError`` naming it."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


# --------------------------------------------------------------------------- checkpoints

#: The format marker every checkpoint carries (a foreign ``.pt`` file lacks it).
FORMAT = "mcgraph-checkpoint"
VERSION = 1


def save_checkpoint(path: str | os.PathLike, state: dict, *, keep: int = 0) -> None:
    """Atomically ``torch.save`` the dict ``state`` (tensors, numbers, strings, lists, dicts) to ``path``,
    keeping ``keep`` previous versions. ``state`` gets the format marker :data:`FORMAT`."""
    import torch

    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    with atomic_write(path, "wb", keep=keep) as f:
        torch.save({"format": FORMAT, "version": VERSION, **state}, f)


def _load_one(path: Path, map_location, required: tuple[str, ...]) -> dict:
    import pickle

    import torch

    if not path.exists():
        raise CheckpointError(path, "no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(path, "the file is empty (torn by an interrupted write?)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(path, "refused: it holds objects other than tensors and plain data, which "
                              f"torch.load(weights_only=True) does not run ({first})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(path, f"not a complete torch checkpoint (torn by an interrupted write, or not "
                              f"a torch file): {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a checkpoint dict")
    if state.get("format") != FORMAT:
        raise CheckpointError(path, f"not an mcgraph checkpoint (no format marker {FORMAT!r}; keys "
                              f"{sorted(map(str, state))[:8]})")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(path, f"lacks {missing}")
    return state


def load_checkpoint(path: str | os.PathLike, *, map_location=None, fallback: bool = False,
                    required: tuple[str, ...] = ("model", "optimizer", "epoch", "step"),
                    validate=None, warn=None) -> tuple[dict, Path]:
    """``(state, the file it came from)``: the checkpoint at ``path`` read with ``weights_only=True``.

    Args:
        fallback: when ``path`` cannot be used, try its kept previous versions (``path.1``, …) in turn.
        required: keys the checkpoint must hold.
        validate: ``validate(state, path)`` raising :class:`CheckpointError` when the state does not fit
            (a checkpoint of another model); with ``fallback`` a failed validation also moves on.
        warn: called with a message for each version skipped by the fallback.

    Raises:
        CheckpointError: naming the file (and, with ``fallback``, every version tried) and what is wrong.
    """
    path = Path(path)
    candidates = [path] + (previous_versions(path) if fallback else [])
    errors = []
    for candidate in candidates:
        try:
            state = _load_one(candidate, map_location, required)
            if validate is not None:
                validate(state, candidate)
            return state, candidate
        except CheckpointError as e:
            errors.append(e)
            if warn is not None and fallback:
                warn(f"{e}; trying the previous checkpoint" if candidate is not candidates[-1] else str(e))
    if len(errors) == 1:
        raise errors[0]
    raise CheckpointError(path, "no usable version: " + "; ".join(str(e) for e in errors))
