"""``fastoptim.native``: C++ read from the files the package ships, assembled into one source, built once per
cache folder even by processes that need it at the same time, and loaded."""

import os
import subprocess
import sys
import textwrap

import pytest

import fastoptim
from fastoptim import native

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")


def test_sources_are_the_package_files_and_headers_are_inlined_once():
    assert native.source_dir() == os.path.dirname(native.__file__)
    slots = dict(width="5", block="256", constants="", scalars="", codecs="", arrays="", tops="", loads="",
                 lane_reads="", lane_body="", lane_writes="", tails="",
                 deferred_decls="", deferred_lanes="", deferred_rest="", deferred_finish="", deferred_flush="", reads="", body="", writes="", merge_tops="",
                 stores="", probes="")
    source = native.assemble("step_kernel.cpp", **slots)
    assert '#include "' not in source  # the headers inlined, so the cache key covers them
    for header in ("COMMON", "CODEC", "LANES", "MINIFLOAT"):
        assert source.count(f"#define FO_{header}_HPP") == 1
    assert "constexpr int64_t WIDTH = 5;" in source and "${width}" not in source
    for name in ("step_kernel.cpp", "codec.hpp", "common.hpp", "lanes.hpp", "minifloat.hpp"):
        assert native.sources_read[name] == os.path.join(native.source_dir(), name)
    del slots["probes"]
    with pytest.raises(KeyError, match="probes"):  # a slot left unfilled is an error, not a silent blank
        native.assemble("step_kernel.cpp", **slots)


def test_the_python_files_carry_no_cpp_source():
    """The fixed C++ lives in the shipped files; what Python generates are one-line pieces."""
    package = os.path.dirname(fastoptim.__file__)
    for name in (os.path.join("native", "bulk.py"), os.path.join("paths", "cpu_kernel", "kernels.py")):
        with open(os.path.join(package, name)) as f:
            text = f.read()
        assert "#include" not in text and 'extern "C"' not in text, name


@needs_compiler
def test_two_processes_that_need_one_library_build_it_once(tmp_path):
    """Two processes (two pytest-xdist workers, say) ask for one library in an empty cache at the same moment:
    one compiles it, the other waits for it and loads what was built (a slow compiler makes them overlap)."""
    log = tmp_path / "compiles.log"
    slow_cxx = tmp_path / "slow-c++"
    slow_cxx.write_text(f"#!/bin/sh\necho run >> {log}\nsleep 2\nexec {native.compiler()} \"$@\"\n")
    slow_cxx.chmod(0o755)
    script = textwrap.dedent(f"""
        import os, sys, time, importlib.util
        spec = importlib.util.spec_from_file_location("native", {native.__file__!r})  # native alone, no torch
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        open(os.path.join({str(tmp_path)!r}, "ready" + sys.argv[1]), "w").close()
        while len([f for f in os.listdir({str(tmp_path)!r}) if f.startswith("ready")]) < 2:
            time.sleep(0.01)
        lib = native.load("answer", 'extern "C" int fo_answer() {{ return 42; }}', ["-O0", "-shared", "-fPIC"])
        print(lib.fo_answer(), len(native.built))
    """)
    env = dict(os.environ, CXX=str(slow_cxx), FASTOPTIM_CACHE=str(tmp_path / "cache"))
    runs = [subprocess.Popen([sys.executable, "-c", script, str(k)], env=env, stdout=subprocess.PIPE, text=True)
            for k in range(2)]
    answers = sorted(run.communicate(timeout=120)[0].split() for run in runs)
    assert answers == [["42", "0"], ["42", "1"]]  # both loaded it; one of them built it
    assert log.read_text().count("run") == 1
    assert len(list((tmp_path / "cache").glob("answer_*.so"))) == 1


@needs_compiler
def test_kernels_read_the_system_headers_precompiled(tmp_path, monkeypatch):
    """GCC builds a kernel from system.hpp's precompiled form, made once in the cache (parsing <immintrin.h> was
    most of a small kernel's build); clang parses the headers as before."""
    from fastoptim.paths.cpu_kernel import kernels
    from fastoptim.rules.sgd import sgd_update
    from fastoptim.storage import Format

    monkeypatch.setenv("FASTOPTIM_CACHE", str(tmp_path))
    cxx = native.required_compiler()
    key = (sys.platform, native.target(cxx))
    extra = native.precompiled_flags(cxx, "system.hpp", kernels.CXXFLAGS, key)
    if "__clang__" in native.target(cxx):
        assert extra == ()
        return
    assert extra[0] == "-include" and os.path.exists(extra[1] + ".gch")
    source = tmp_path / "kernel.cpp"
    source.write_text(kernels.kernel_source(sgd_update, (False, False, True, False), (Format(16),), 5))
    shown = subprocess.run([cxx, *extra, *kernels.CXXFLAGS, "-H", str(source), "-o", str(tmp_path / "k.so")],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"! {extra[1]}.gch" in shown.stderr  # GCC's -H marks a precompiled header it used with "!"
    assert "immintrin.h" not in shown.stderr  # not parsed again


@pytest.mark.slow
@needs_compiler
def test_a_kernel_builds_after_its_precompiled_header_is_gone_or_damaged(tmp_path, monkeypatch):
    """The cache folder changed (a test's tmp_path) or emptied while the process runs, or a damaged ``.gch``
    beside no header: the kernel still builds, and runs (the header is made again, or parsed)."""
    import shutil

    from fastoptim.paths.cpu_kernel import kernels
    from fastoptim.rules.sgd import sgd_update
    from fastoptim.storage import Format

    cxx = native.required_compiler()
    key = (sys.platform, native.target(cxx))
    first = tmp_path / "first"
    monkeypatch.setenv("FASTOPTIM_CACHE", str(first))
    extra = native.precompiled_flags(cxx, "system.hpp", kernels.CXXFLAGS, key)
    shutil.rmtree(first)
    monkeypatch.setenv("FASTOPTIM_CACHE", str(tmp_path / "second"))
    source = kernels.kernel_source(sgd_update, (False, False, True, False), (Format(16),), 5)
    assert native.load("kernel", source, kernels.CXXFLAGS, key=key, precompiled="system.hpp").fo_simd_width() >= 0
    if extra:  # GCC: the second folder has its own precompiled header, and a damaged one is not fatal
        again = native.precompiled_flags(cxx, "system.hpp", kernels.CXXFLAGS, key)
        assert again[1].startswith(str(tmp_path / "second")) and os.path.exists(again[1] + ".gch")
        with open(again[1] + ".gch", "wb") as f:
            f.write(b"not a precompiled header")
        os.remove(again[1])
        other = kernels.kernel_source(sgd_update, (True, False, True, False), (Format(16),), 5)
        assert native.load("kernel", other, kernels.CXXFLAGS, key=key, precompiled="system.hpp").fo_simd_width() >= 0
