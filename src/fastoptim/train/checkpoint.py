"""Checkpoint files that survive a crash, a ``kill -9`` or a power loss.

A file is written to ``<path>.tmp.<pid>``, fsynced, renamed over ``<path>``, and the folder fsynced: after a
power loss the path holds the old checkpoint or the new one, never an empty or short file (a rename is
atomic, but without the fsyncs the file system may commit the rename before the data). A folder (a DCP
checkpoint, one file per rank) is committed the same way: every file and the folder fsynced, renamed, the
parent fsynced. Temporary files and folders that a killed process left behind are removed by the next save
or resume; a save that raises removes its own.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable

import torch


def fsync_path(path: str) -> None:
    """Flush a file's data, or a folder's entries (renames, new names), to the disk."""
    flags = os.O_RDONLY
    if os.path.isdir(path):
        if os.name == "nt":  # Windows opens no folders; its renames are not fsynced through one
            return
        flags |= getattr(os, "O_DIRECTORY", 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def write_atomic(path: str, write: Callable[[object], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then fsync, rename over ``path`` and fsync the
    folder. On an exception the temporary file is removed and ``path`` is left as it was."""
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def save(obj, path: str) -> None:
    """``torch.save`` that never leaves half a checkpoint at ``path``."""
    write_atomic(path, lambda f: torch.save(obj, f))


def commit_dir(tmp: str, path: str) -> None:
    """Make the finished folder ``tmp`` the folder ``path``: fsync its files and itself, rename, fsync the
    parent. ``path`` must not exist (name each commit afresh, e.g. by step, and drop old ones afterwards)."""
    for root, _, files in os.walk(tmp):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)
    os.rename(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _stale(pid: str) -> bool:
    """A temporary name's pid is stale when no such process runs, or it is ours: this process is not in the
    middle of writing it (saves are synchronous), so an earlier process with the same pid left it."""
    return int(pid) == os.getpid() or not _pid_alive(int(pid))


def remove_stale_temps(path: str) -> list[str]:
    """Remove ``<path>.tmp.<pid>`` files left by processes that died while saving; returns their names."""
    folder, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.tmp\.(\d+)")
    removed = []
    for name in _listdir(folder):
        m = pattern.fullmatch(name)
        if m and _stale(m.group(1)):
            _remove(os.path.join(folder, name))
            removed.append(name)
    return removed


def remove_dirs(folder: str, pattern: str, keep: str | None = None) -> list[str]:
    """Remove the folders in ``folder`` whose names fully match the regex ``pattern``, except ``keep``."""
    removed = []
    for name in _listdir(folder):
        if name != keep and re.fullmatch(pattern, name) and os.path.isdir(os.path.join(folder, name)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(name)
    return removed


def _listdir(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# the DCP folders of --fsdp checkpoints: dcp-<step>-<random> (ckpt.pt names the one it goes with), their
# temporary folders (.tmp) and the single folder of older versions (dcp, dcp.tmp, dcp.old)
DCP_DIRS = r"dcp(-\d+-[0-9a-f]+)?(\.tmp|\.old)?"
DCP_TEMPS = r"dcp(-\d+-[0-9a-f]+)?(\.tmp|\.old)"


def save_sharded(model, opt, out_dir: str, step: int, master: bool) -> str:
    """FSDP2: each rank writes its shards through torch.distributed.checkpoint into a temporary folder; once
    every rank has finished, rank 0 fsyncs it and renames it to a new name, which it returns. The folder
    counts once ckpt.pt names it (written after this), so a crash at any point leaves ckpt.pt and the
    folder it names as they were; the caller removes the older folders after that commit."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    name = [None]
    if master:  # before the others start writing: temporary folders of killed saves go
        remove_dirs(out_dir, DCP_TEMPS)
        name = [f"dcp-{step:08d}-{os.urandom(4).hex()}"]  # new even where an older run saved this step
    dist.broadcast_object_list(name, src=0)
    tmp = os.path.join(out_dir, name[0] + ".tmp")
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    dist.barrier()
    if master:
        commit_dir(tmp, os.path.join(out_dir, name[0]))
    return name[0]


def load_sharded(model, opt, path: str) -> None:
    """FSDP2: the shards of the DCP folder ``path`` into the model and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
