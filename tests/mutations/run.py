"""The mutation sample: apply each hand mutation (``mutations.py``) to a copy of the tree, run the tests, and
say whether a test failed (caught) and which one failed first.

    python tests/mutations/run.py                      # every mutation, the whole suite each (slow)
    python tests/mutations/run.py --likely             # each mutation's likely test files only
    python tests/mutations/run.py --only wsd_linear_1_percent tests/surface/test_schedules.py

The source tree is never touched: the tree (``--tree``, by default this checkout) is copied once into a
temporary folder, and each mutation is applied there and undone after its run. pytest runs with
``-x -q -p no:cacheprovider`` and ``PYTHONPATH`` at the copy's ``src``. Native kernels are cached by a hash of
their source, so a mutated kernel builds once into the cache (``FASTOPTIM_CACHE``; ``--cache`` sets it)
beside the real ones and never replaces them.

Not caught in the likely files says nothing yet: a mutation counts as caught only if some test of the whole
suite fails, so run those on the whole suite (the default test path).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutations import MUTATIONS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info",
                                 "build", "dist", "bench-out")


def first_failure(output: str) -> str:
    """The first failing (or erroring) test pytest -q names, else the error line that stopped the run."""
    for line in output.splitlines():
        match = re.match(r"(FAILED|ERROR) (\S+)", line)
        if match:
            return match.group(2)
    for line in output.splitlines():
        if "Error" in line or "error" in line:
            return line.strip()[:120]
    return ""


def site_in(mutation, tree: str):
    """The mutation's site whose old text occurs exactly once in ``tree``, and that file's text; else None and
    why not (no site found, or several: which files, how many times)."""
    found, seen = [], []
    for site in mutation.sites:
        path = os.path.join(tree, site.file)
        if not os.path.exists(path):
            seen.append(f"{site.file}: no file")
            continue
        with open(path) as f:
            text = f.read()
        count = text.count(site.old)
        seen.append(f"{site.file}: {count}")
        if count == 1:
            found.append((site, text))
        elif count > 1:
            return None, f"old text found {count} times in {site.file}"
    if len(found) == 1:
        return found[0], ""
    return None, ("no site's old text found once (" if not found else "several sites match (") + "; ".join(seen) + ")"


def run_one(mutation, tree: str, tests: list[str], timeout: float, env: dict, select: str = "") -> dict:
    match, why = site_in(mutation, tree)
    if match is None:
        return {"name": mutation.name, "result": why, "test": "", "seconds": 0.0}
    site, original = match
    path = os.path.join(tree, site.file)
    tests = [t for t in tests if os.path.exists(os.path.join(tree, t.split("::")[0]))]
    if not tests:
        return {"name": mutation.name, "result": "no test file here", "test": "", "seconds": 0.0}
    start = time.monotonic()
    try:
        with open(path, "w") as f:
            f.write(original.replace(site.old, site.new))
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        if select:
            command += ["-k", select]
        try:
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            rc, output = None, ""
    finally:
        with open(path, "w") as f:
            f.write(original)
    seconds = time.monotonic() - start
    if rc is None:
        result = "timed out"
    elif rc == 0:
        result = "not caught"
    elif rc == 1:
        result = "caught"
    else:  # 2: interrupted / collection error, 3: internal error, 4: usage, 5: no tests
        result = f"pytest rc {rc}"
    return {"name": mutation.name, "result": result, "test": first_failure(output) if rc else "",
            "seconds": round(seconds, 1), "tests": tests, "file": site.file}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", default=["tests"], help="test paths (default: the whole suite)")
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(HERE)),
                        help="the source tree to mutate a copy of (default: this checkout)")
    parser.add_argument("--only", nargs="+", default=None, help="names of the mutations to run")
    parser.add_argument("--likely", action="store_true", help="run each mutation's likely test files")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per mutation")
    parser.add_argument("--cache", default=None, help="FASTOPTIM_CACHE for the runs (the kernel cache)")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    args = parser.parse_args(argv)

    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.only is not None and len(chosen) != len(set(args.only)):
        parser.error(f"unknown mutation names: {sorted(set(args.only) - {m.name for m in chosen})}")
    if args.list:
        for m in chosen:
            print(f"{m.name:50s} {' | '.join(s.file for s in m.sites)}  {m.what}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        tree = os.path.join(scratch, "tree")
        shutil.copytree(args.tree, tree, ignore=IGNORED)
        env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"), PYTHONDONTWRITEBYTECODE="1")
        if args.cache:
            env["FASTOPTIM_CACHE"] = args.cache
        rows = []
        for m in chosen:
            if args.likely:
                row = run_one(m, tree, list(m.likely), args.timeout, env, m.select)
            else:
                row = run_one(m, tree, args.tests, args.timeout, env)
            rows.append(row)
            print(f"| {m.name} | {row.get('file', '')} | {row['result']} | {row['test']} | {row['seconds']} s |",
                  flush=True)
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"\ncaught {caught} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
