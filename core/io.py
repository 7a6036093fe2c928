"""Atomic file writes and checksums.

Every file draftheads writes goes to a temporary file in the destination directory and is
then ``os.replace``-d into place, so a killed process never leaves a half-written file under
the final name.  Nothing is ever pickled: tensors go to safetensors, everything else to JSON
or YAML.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch


class DamagedFile(OSError):
    """A file draftheads reads is not what it wrote (torn by a full disk or a copy, or edited): the
    command line prints ``error: <file>: <reason>`` (``core.config.report_errors``, as for any
    ``OSError``), the reason saying how to recover."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(None, reason, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


#: how to recover a damaged data-prep cache manifest: data prep rewrites it from the shards' sidecars
MANIFEST_FIX = "rerun data prep with the same settings to rewrite it (its finished shards are kept)"


def read_json(path: str | os.PathLike, fix: str = "") -> Any:
    """``json.loads`` of the UTF-8 file ``path``.

    Raises:
        FileNotFoundError: no such file.
        DamagedFile: it is not JSON (the line and column, then ``fix``, are in the message).
    """
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DamagedFile(path, f"not UTF-8 text ({exc.reason}){'; ' + fix if fix else ''}") from exc
    except json.JSONDecodeError as exc:
        raise DamagedFile(path, f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
                                f"{'; ' + fix if fix else ''}") from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tmp_path(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; give the final file the permissions open() would (0666 & ~umask),
    # so caches and checkpoints on shared cluster storage stay readable by the group.
    os.chmod(tmp, 0o666 & ~_umask())
    return Path(tmp)


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or become) a folder to write into, or ``None`` when it can.

    Looked at before anything is written, so that a bad output path is refused by name instead of
    failing in ``mkdir`` after minutes of work.  Reasons: ``path`` or one of its ancestors exists and
    is not a folder, or the deepest existing ancestor is a folder this process cannot write into:
    ``os.access`` with ``W_OK | X_OK``, then a probe folder made and removed there, which also catches
    what root cannot write either (``/proc``, ``/sys``, a read-only mount).  Nothing is left behind.

    Args:
        path: the output folder (need not exist; ``~`` is expanded).
    Returns:
        One sentence naming the offending path, or ``None``.
    """
    p = Path(path).expanduser()
    p = p if p.is_absolute() else Path.cwd() / p
    for node in (p, *p.parents):
        if node.exists() or node.is_symlink():
            if not node.is_dir():
                what = "a broken link" if node.is_symlink() and not node.exists() else "a file"
                return f"{node} is {what}, not a folder"
            if not os.access(node, os.W_OK | os.X_OK):
                return f"{node} is a folder this user cannot write into"
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".draftheads-probe-", dir=node))
            except OSError as exc:
                return f"{node} is a folder nothing can be created in ({exc.strerror or type(exc).__name__})"
            return None
    return None


def names_a_local_path(path: str, suffixes: tuple[str, ...] = ()) -> bool:
    """True when ``path`` can only be meant as a local file or folder, never as a Hugging Face hub id
    (``name`` or ``owner/name``): it starts with ``.``, ``/`` or ``~``, ends in one of ``suffixes``
    (compared lower-case: a file type such as ``.jsonl`` or ``.gguf``), has more than one ``/``, or a
    backslash.  A missing path that names a local one is refused as missing, instead of being sent to
    the hub, whose error ("Repo id must be in the form...") names no file."""
    p = str(path)
    return (p.startswith((".", "/", "~")) or (bool(suffixes) and p.lower().endswith(tuple(suffixes)))
            or p.count("/") > 1 or "\\" in p)


def make_tmp_dir(prefix: str, parent: str | os.PathLike) -> Path:
    """A fresh temporary directory inside ``parent`` (created if needed), to be filled and then
    ``os.replace``-d into its final name; permissions as ``mkdir`` would give (0777 & ~umask)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``, kernel 3.15+,
    glibc 2.28+); False where the kernel, the C library or the file system does not offer it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def interrupted_swap(target: str | os.PathLike) -> Path | None:
    """The previous contents of ``target`` left by a :func:`replace_dir` stopped between its two renames (only where
    the atomic exchange is unavailable): ``.<name>.old-<pid>`` beside it, the newest first; None when there is none."""
    target = Path(target)
    olds = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return olds[0] if olds else None


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the directory ``new`` (a sibling made by :func:`make_tmp_dir` and filled) at ``target``, replacing what
    was there, so that a reader or a crash sees the whole old folder or the whole new one, never a mix.

    Where ``target`` exists the two are exchanged in one atomic step (:func:`_exchange`) and the old contents
    removed; without that system call the old folder is first renamed to ``.<name>.old-<pid>``, so a crash
    between the two renames leaves it there, whole (:func:`interrupted_swap` finds it).

    Raises:
        OSError: a rename fails (nothing is removed then).
    """
    new, target = Path(new), Path(target)
    if not os.path.lexists(target):
        os.replace(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # now the old contents
    else:
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    Raises:
        OSError: the write failed (a full disk, a denied folder); its message names ``path`` and how many bytes
            were being written, and ``path`` keeps its earlier contents.
    """
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # "[Errno 28] No space left on device" alone names no file
        if exc.filename is None:
            raise type(exc)(exc.errno, f"{exc.strerror or exc} while writing {path} ({len(data):,} bytes)",
                            str(path)) from exc
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Save ``tensors`` (name -> contiguous CPU tensor) as a safetensors file atomically, byte for byte
    the same for the same tensors and metadata (:func:`safetensors_bytes`).

    ``metadata`` values must be strings (a safetensors restriction).
    """
    atomic_write_bytes(path, safetensors_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata))


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``safetensors.torch.save`` with a canonical header, so that equal tensors and metadata give
    equal bytes, and a file's SHA-256 identifies its content (checkpoints, cache shards, manifests).

    The library writes ``__metadata__`` in hash-map order, which changes from call to call; the
    header JSON is rewritten with every key sorted and padded with spaces to 8 bytes, as the format
    allows.  The tensor data and its offsets are the library's own.
    """
    from safetensors.torch import save

    data = save(dict(tensors), metadata=dict(metadata) if metadata else None)
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def manifest_identity(directory: str | os.PathLike, name: str = "manifest.json") -> dict[str, Any] | None:
    """The identity of one data-prep cache split: ``{"sha256", "records", "tokens", "config_hash"}``
    of ``directory/<name>``, or None when it has none (data prep has not finished there).

    The manifest lists every shard's SHA-256 and record count, so its own SHA-256 changes with any
    rebuilt shard of other bytes, and a deterministic re-run of data prep gives the same one.  What
    resume checks (``train.resume.data_identity``) and what a shipped head records
    (``heads.ship.cache_identity``).

    Raises:
        DamagedFile: the manifest is not JSON (the message names it).
    """
    path = Path(directory) / name
    if not path.is_file():
        return None
    m = read_json(path, MANIFEST_FIX)
    return {"sha256": sha256_file(path), "records": m.get("num_records"), "tokens": m.get("num_tokens"),
            "config_hash": m.get("config_hash")}


def sha256_json(obj: Any) -> str:
    """Hex SHA-256 of the canonical (key-sorted, compact) JSON encoding of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
