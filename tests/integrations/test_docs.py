"""Every snippet of docs/integrations.md runs: the snippets of one section in one namespace, in order; a snippet
marked ``<!-- script -->`` (one that starts processes by running its own file again, as Lightning's DDP does) as a
file of its own, in a fresh process."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastoptim

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def sections() -> dict[str, list[tuple[list[str], str, bool]]]:
    """Section title -> [(the modules the snippet requires, its code, whether it runs as a script)]."""
    out: dict[str, list] = {}
    title = None
    requires, script = [], False
    lines = iter(DOC.read_text().splitlines())
    for line in lines:
        if line.startswith("## "):
            title = line[3:].strip()
        elif m := re.match(r"<!-- requires: (.+?) -->", line):
            requires = m.group(1).split()
        elif line.strip() == "<!-- script -->":
            script = True
        elif line.startswith("```python"):
            code = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                code.append(inner)
            out.setdefault(title, []).append((requires, "\n".join(code), script))
            requires, script = [], False
    return out


SECTIONS = sections()
SCRIPTS = [(title, requires, code) for title, snippets in SECTIONS.items()
           for requires, code, script in snippets if script]


def _import(requires):
    for module in requires:
        try:
            importlib.import_module(module)
        except Exception as e:  # timm imports torchvision, whose build may not match the installed torch
            pytest.skip(f"{module} does not import here ({type(e).__name__}: {e})")


def test_the_doc_has_every_framework():
    assert {"HF Trainer", "Lightning", "accelerate", "timm", "A torchtitan-style builder"} <= set(SECTIONS)


@pytest.mark.parametrize("title", list(SECTIONS))
def test_snippets_run(title, tmp_path):
    namespace = {"out_dir": str(tmp_path)}
    for requires, code, script in SECTIONS[title]:
        if script:
            continue
        _import(requires)
        exec(compile(code, f"{DOC.name}:{title}", "exec"), namespace)


@pytest.mark.slow  # (each process imports torch and the trainer: tens of seconds on two CPU cores)
@pytest.mark.parametrize("title,requires,code", SCRIPTS, ids=[f"{title}-{i}" for i, (title, _, _) in
                                                               enumerate(SCRIPTS)])
def test_script_snippets_run(title, requires, code, tmp_path):
    _import(requires)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(fastoptim.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
