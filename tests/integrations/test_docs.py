"""Every snippet of docs/integrations.md runs: the snippets of one section in one namespace, in order."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def sections() -> dict[str, list[tuple[str | None, str]]]:
    """Section title -> [(the module the snippet requires, its code)]."""
    out: dict[str, list] = {}
    title = None
    requires = None
    lines = iter(DOC.read_text().splitlines())
    for line in lines:
        if line.startswith("## "):
            title = line[3:].strip()
        elif m := re.match(r"<!-- requires: (\S+) -->", line):
            requires = m.group(1)
        elif line.startswith("```python"):
            code = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                code.append(inner)
            out.setdefault(title, []).append((requires, "\n".join(code)))
            requires = None
    return out


SECTIONS = sections()


def test_the_doc_has_every_framework():
    assert {"HF Trainer", "Lightning", "accelerate", "timm", "A torchtitan-style builder"} <= set(SECTIONS)


@pytest.mark.parametrize("title", list(SECTIONS))
def test_snippets_run(title, tmp_path):
    namespace = {"out_dir": str(tmp_path)}
    for requires, code in SECTIONS[title]:
        if requires:
            try:
                importlib.import_module(requires)
            except Exception as e:  # timm imports torchvision, whose build may not match the installed torch
                pytest.skip(f"{requires} does not import here ({type(e).__name__}: {e})")
        exec(compile(code, f"{DOC.name}:{title}", "exec"), namespace)
