"""Native code: C++ kept as real files beside this module, built once per machine, cached, and loaded.

The files ship as package data (``*.cpp``, ``*.hpp``) and are read with ``importlib.resources``, so a wheel
install builds from the files it installed. ``assemble`` reads a file, inlines the headers it includes with
``#include "name.hpp"`` (so one source text, and so one cache key, covers every file it is made of), and fills
its ``${name}`` slots with generated pieces (``string.Template``).

``load`` compiles a source with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) into the
cache folder (``$FASTOPTIM_CACHE``, else ``~/.cache/fastoptim``) under a name that hashes the source, the
compiler, its flags and whatever else the caller names (the CPU ``-march=native`` means, torch's version), and
loads it. A kernel may name a shipped header to precompile (``precompiled=``): GCC then parses it once per
machine and flags, not once per kernel (a build that cannot use it parses the text instead; the code is the same).
A build is written atomically (a temporary file, then a rename), under a file lock: of two processes
that need one library (two pytest-xdist workers), one builds and the other waits, then loads what it built.
Where there is no compiler, the build fails or the cache folder is not usable, ``KernelUnavailable`` says why.

This is the bottom layer: it imports nothing from the rest of fastoptim.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import shutil
import string
import struct
import subprocess
import tempfile
from functools import lru_cache
from importlib import resources
from typing import Callable, Sequence

try:
    import fcntl
except ImportError:  # no POSIX file locks (Windows): concurrent builds then both build, and the rename keeps one
    fcntl = None

BUILD_TIMEOUT_S = 300


class KernelUnavailable(RuntimeError):
    """No C++ compiler here, or the kernel failed to build: the caller runs a path without it."""


# --- the shipped sources ----------------------------------------------------------------------------------

sources_read: dict[str, str] = {}  # file name -> where it was read from (this process)
built: list[str] = []  # libraries this process compiled (a cache hit builds nothing)


def float_literal(value: float) -> str:
    """An exact C++ spelling of ``value`` rounded to fp32 (as torch rounds a Python scalar)."""
    as_fp32 = struct.unpack("f", struct.pack("f", float(value)))[0]
    if math.isnan(as_fp32):
        return "NAN"
    if math.isinf(as_fp32):
        return "INFINITY" if as_fp32 > 0 else "-INFINITY"
    return f"{as_fp32.hex()}f"


def source_dir() -> str:
    """The folder the C++ files are read from (inside the installed package)."""
    return os.fspath(resources.files(__name__))


@lru_cache(maxsize=None)
def read(name: str) -> str:
    """The text of the shipped file ``name``."""
    file = resources.files(__name__).joinpath(name)
    text = file.read_text(encoding="utf-8")
    sources_read[name] = os.fspath(file)
    return text


_INCLUDE = re.compile(r'^#include "([\w.]+)"[^\n]*$', re.MULTILINE)


def _inline(name: str, seen: set[str]) -> str:
    """``name`` with each ``#include "x.hpp"`` replaced by x's text (once per source: the rest are dropped)."""

    def include(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _inline(header, seen)

    return _INCLUDE.sub(include, read(name))


def assemble(name: str, **pieces: str) -> str:
    """The shipped file ``name`` as one source text: its own headers inlined, each ``${piece}`` filled (a slot
    without a piece raises ``KeyError``)."""
    return string.Template(_inline(name, {name})).substitute(pieces)


# --- the compiler ---------------------------------------------------------------------------------------

def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def required_compiler() -> str:
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
    return cxx


def cache_dir() -> str:
    return os.environ.get("FASTOPTIM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastoptim")


@lru_cache(maxsize=None)
def target(cxx: str) -> str:
    """What ``-march=native`` means on this machine, as the compiler sees it (its predefined macros): part of a
    built kernel's name, so a cache folder shared by machines of other CPUs never loads a kernel built for
    instructions this one lacks."""
    try:
        done = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{os.path.basename(cxx)} could not be run: {e}") from None
    if done.returncode != 0:
        raise KernelUnavailable(f"{os.path.basename(cxx)} does not take -march=native: {done.stderr.strip()[-500:]}")
    return "\n".join(sorted(done.stdout.splitlines()))


# --- building and loading -------------------------------------------------------------------------------

def _build(cxx: str, source: str, path: str, flags: Sequence[str], libraries: Sequence[str]) -> None:
    """Compile ``source`` into the shared library ``path`` (written atomically); ``libraries``: linker flags
    after the source."""
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, "kernel.cpp")
        with open(src, "w") as f:
            f.write(source)
        out = os.path.join(work, "kernel.so")
        try:
            done = subprocess.run([cxx, *flags, src, "-o", out, *libraries], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.SubprocessError as e:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: {e}") from None
        if done.returncode != 0:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(out, path)  # atomic: a reader sees no file or the whole one
    built.append(path)


@contextlib.contextmanager
def _locked(path: str):
    """Held by one process at a time for ``path`` (an advisory lock on ``path.lock``, freed when the holder
    exits, even killed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def load_built(load: Callable, cxx: str, source: str, path: str, flags: Sequence[str],
               libraries: Sequence[str] = ()):
    """``load(path)`` of the library built from ``source`` at ``path`` (built there first where missing, by one
    process while others wait; a cached file that does not load is built again once). A folder that cannot be
    written or a file that still does not load raises ``KernelUnavailable``."""
    try:
        for attempt in (0, 1):
            if not os.path.exists(path):
                with _locked(path):
                    if not os.path.exists(path):  # not built meanwhile by the process that held the lock
                        _build(cxx, source, path, flags, libraries)
            try:
                return load(path)
            except (OSError, ImportError):
                if attempt:
                    raise
                with _locked(path), contextlib.suppress(FileNotFoundError):
                    os.remove(path)  # cut short or damaged: built again
    except (OSError, ImportError) as e:
        raise KernelUnavailable(f"the kernel cache {cache_dir()!r} is not usable ({e}); set FASTOPTIM_CACHE "
                                "to a writable folder") from None
    raise AssertionError("unreachable")


_PCH_FAILED: set = set()  # (compiler, header, flags, key, cache folder) whose precompiled header did not build


def precompiled_flags(cxx: str, header: str, flags: tuple, key: tuple) -> tuple:
    """The flags that make a build with ``flags`` read the shipped ``header`` precompiled: ``-include`` of its copy
    in the cache, beside the ``.gch`` built from it once (under the lock, written atomically). GCC only, and only
    where that build succeeds: else () and each build parses the header itself, with the same result. Both files
    are looked for on every call (the cache folder may change or be emptied while a process runs)."""
    if "__clang__" in target(cxx):  # (clang reads another PCH format)
        return ()
    flags = tuple(f for f in flags if f != "-shared")
    text = read(header)
    digest = hashlib.sha256("\0".join((text, cxx, *flags, *key)).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"{os.path.splitext(header)[0]}_{digest}.hpp")
    if (cxx, header, flags, key, cache_dir()) in _PCH_FAILED:
        return ()
    if os.path.exists(path) and os.path.exists(path + ".gch"):
        return ("-include", path)
    try:
        with _locked(path + ".gch"):
            if not (os.path.exists(path) and os.path.exists(path + ".gch")):
                with tempfile.TemporaryDirectory(dir=cache_dir()) as work:
                    copy = os.path.join(work, "header.hpp")
                    with open(copy, "w") as f:
                        f.write(text)
                    os.replace(copy, path)
                    out = os.path.join(work, "header.gch")
                    done = subprocess.run([cxx, *flags, "-x", "c++-header", path, "-o", out], capture_output=True,
                                          timeout=BUILD_TIMEOUT_S)
                    if done.returncode != 0:
                        raise OSError(done.stderr[-500:])
                    os.replace(out, path + ".gch")
    except (OSError, subprocess.SubprocessError):
        _PCH_FAILED.add((cxx, header, flags, key, cache_dir()))
        return ()
    return ("-include", path)


def load(stem: str, source: str, flags: Sequence[str], libraries: Sequence[str] = (), key: Sequence[str] = (),
         suffix: str = ".so", loader: Callable = ctypes.CDLL, cxx: str | None = None, precompiled: str | None = None):
    """``loader`` of the library built from ``source`` with ``flags`` (and linker flags ``libraries``), cached as
    ``<stem>_<hash><suffix>``; the hash covers the source, the compiler, its flags and ``key``. ``precompiled``: a
    shipped header that ``source`` includes, to build from its precompiled form (``precompiled_flags``)."""
    cxx = cxx or required_compiler()
    digest = hashlib.sha256("\0".join((source, cxx, *flags, *libraries, *key)).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"{stem}_{digest}{suffix}")
    fast = precompiled_flags(cxx, precompiled, tuple(flags), tuple(key)) if precompiled and not os.path.exists(path) \
        else ()
    if fast:
        try:
            return load_built(loader, cxx, source, path, (*fast, *flags), libraries)
        except KernelUnavailable:  # the precompiled header went bad (or the source does not build: said below)
            pass
    return load_built(loader, cxx, source, path, flags, libraries)
