"""File helpers: writes that a reader, or a crash, never sees half of, and JSON read with a one-line error."""

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import IO, Callable

Writer = Callable[[IO[bytes]], object]  # writes a file's bytes to an open binary file


def remove_file(path: str) -> None:
    pathlib.Path(path).unlink(missing_ok=True)


def fsync_dir(folder: str) -> None:
    """Make renames inside `folder` durable (skipped where a directory cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_writable(folder: str | os.PathLike, what: str, *, files: tuple[str, ...] = ()) -> None:
    """A ValueError naming `what` now, not after a long run, unless a file can be made in `folder` (tried: os.access
    trusts root, whom a read-only mount refuses) and none of `files` there is a folder, which cannot be replaced."""
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".writable.", suffix=".tmp").close()
    except OSError as e:
        raise ValueError(f"{what}: no file can be written in {folder} ({e.strerror})") from None
    if folders := [f for f in files if os.path.isdir(p := os.path.join(folder, f)) and not os.path.islink(p)]:
        raise ValueError(f"{what}: {os.path.join(folder, folders[0])} is a folder where a file goes; move it away")


def atomic_write_files(folder: str | os.PathLike, files: dict[str, Writer]) -> None:
    """Write `files` (name: writer) into temporary files in `folder`, then rename them into place in order; if anything
    raises, those already replaced get their old bytes back (a process killed between renames: `<file>.<pid>.bak`)."""
    folder = os.path.abspath(folder)
    staged: list[tuple[str, str]] = []  # (temporary file, final path)
    done: list[tuple[str, str | None]] = []  # (final path, a link to its old bytes, None if it had none)
    try:
        for name, write in files.items():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            staged.append((tmp, os.path.join(folder, name)))
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes files private; a checkpoint is meant to be shared
        for tmp, final in staged:
            if len(staged) > 1:  # one file needs no undo: os.replace happens entirely or not at all
                backup = f"{final}.{os.getpid()}.bak" if os.path.exists(final) else None
                if backup:
                    remove_file(backup)
                    try:
                        os.link(final, backup)  # keeps the old bytes without copying them
                    except OSError:
                        shutil.copyfile(final, backup)
                done.append((final, backup))
            os.replace(tmp, final)
    except BaseException:
        for final, backup in reversed(done):
            if backup is None:
                remove_file(final)
            else:
                os.replace(backup, final)
        raise
    finally:  # a temporary file is gone once renamed, a backup once restored
        for leftover in [tmp for tmp, _ in staged] + [backup for _, backup in done if backup]:
            remove_file(leftover)
    fsync_dir(folder)


def atomic_write(path: str | os.PathLike, write: Writer) -> None:
    atomic_write_files(os.path.dirname(os.path.abspath(path)), {os.path.basename(path): write})


def text_writer(text: str) -> Writer:
    return lambda f: f.write(text.encode("utf-8"))  # bytes: newlines stay "\n" on every platform


def json_writer(obj: object) -> Writer:
    return text_writer(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike, *, hint: str) -> object:
    """The JSON value in `path`, or a one-line ValueError that names the file and says `hint` (the fix)."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} {'is a folder, not a file' if os.path.isdir(path) else 'is missing'}; {hint}")
    try:
        return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # the last: nested too deeply
        raise ValueError(f"{path} is not readable JSON ({e}); {hint}") from None
