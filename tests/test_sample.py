"""The default run's sample of the large matrices (sampling.py): it takes every value of each key, and the default
run with a ``--rest`` run is exactly the ``--full`` run."""

import os
import subprocess
import sys

import pytest

from conftest import MATRIX
from sampling import cover

HERE = os.path.dirname(os.path.abspath(__file__))

MATRICES = '''
import pytest

@pytest.mark.sample(("a", "b"), "c")
@pytest.mark.parametrize("c", ["x", "y"])
@pytest.mark.parametrize("a,b", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)])
def test_keyed(a, b, c):
    pass

@pytest.mark.sample
@pytest.mark.parametrize("c", ["x", "y"])
@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("a", [1, 2, 3])
def test_pairwise(a, b, c):
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.sample("name")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("level", ["loop", "foreach", "fused"])
@pytest.mark.parametrize("name", ["p", "q", "r"])
def test_devices(name, level, device):
    pass

@pytest.mark.sample("a")
@pytest.mark.parametrize("a,b", [(1, "x"), (2, "x"), pytest.param(3, "x", marks=pytest.mark.slow), (3, "y")])
def test_slow_case(a, b):
    pass

@pytest.mark.parametrize("a", [1, 2, 3])
def test_plain(a):
    pass
'''


def test_the_cover_takes_every_value_of_each_key_in_fewer_rows():
    rows = [dict(name=n, index=i, level=lv) for n, i, lv in MATRIX]
    keys = [("name", "index"), ("name", "level")]
    chosen = cover(rows, keys)
    assert chosen == sorted(set(chosen)) and chosen == cover(rows, keys)  # the same rows every time
    for key in keys:
        assert {tuple(rows[i][k] for k in key) for i in chosen} == {tuple(r[k] for k in key) for r in rows}
    assert len(chosen) < len(rows) / 2


def _collected(folder, *args):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "sampling", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], capture_output=True, text=True, cwd=folder, timeout=120,
                          env=dict(os.environ, PYTHONPATH=HERE))
    return done.returncode, {line for line in done.stdout.splitlines() if "::" in line}, done.stdout + done.stderr


def test_the_default_run_takes_a_cover_and_rest_the_others(tmp_path):
    (tmp_path / "test_m.py").write_text(MATRICES)
    runs = {mode: _collected(tmp_path, *flags) for mode, flags in
            {"default": [], "rest": ["--rest"], "full": ["--full"]}.items()}
    assert all(code == 0 for code, _, _ in runs.values()), {m: out[-1500:] for m, (_, _, out) in runs.items()}
    default, rest, full = (runs[m][1] for m in ("default", "rest", "full"))
    assert len(full) == 10 + 18 + 1 + 3 + 18 + 4 and not default & rest and default | rest == full
    assert {f"test_m.py::test_plain[{a}]" for a in (1, 2, 3)} <= default and "test_m.py::test_slow" in rest
    keyed = [case for case in default if "test_keyed" in case]
    ids = [case.split("[")[1].rstrip("]").rsplit("-", 1) for case in keyed]  # ["a-b", "c"]
    assert len(keyed) == 5  # (a, b) takes 5 values and c 2: each (a, b) once, both c among them
    assert {ab for ab, _ in ids} == {"1-1", "1-2", "2-1", "2-2", "3-1"} and {c for _, c in ids} == {"x", "y"}
    pairwise = [case.split("[")[1].rstrip("]").split("-") for case in default if "test_pairwise" in case]
    for i, j in [(0, 1), (0, 2), (1, 2)]:  # every pair of values of every two parameters
        assert {(c[i], c[j]) for c in pairwise} == {(x[i], x[j]) for x in (
            case.split("[")[1].rstrip("]").split("-") for case in full if "test_pairwise" in case)}
    assert len(pairwise) < 18
    devices = [case.split("[")[1].rstrip("]").split("-") for case in default if "test_devices" in case]
    for device in ("cpu", "cuda"):  # a sample on each device, and on each the names take different levels
        taken = [(name, level) for name, level, d in devices if d == device]
        assert sorted(name for name, _ in taken) == ["p", "q", "r"] and len({lv for _, lv in taken}) == 3
    # the slow case is left out, and a = 3 is still taken, by the case that is not slow
    assert "test_m.py::test_slow_case[3-x]" in rest and "test_m.py::test_slow_case[3-y]" in default


def test_full_and_rest_together_are_refused(tmp_path):
    (tmp_path / "test_m.py").write_text(MATRICES)
    code, _, out = _collected(tmp_path, "--full", "--rest")
    assert code != 0 and "pick one" in out


def test_a_sample_mark_on_a_test_without_parameters_is_named(tmp_path):
    (tmp_path / "test_m.py").write_text("import pytest\n\n@pytest.mark.sample\ndef test_x():\n    pass\n")
    code, _, out = _collected(tmp_path)
    assert code != 0 and "test_x" in out and "not parametrized" in out


@pytest.mark.parametrize("keys", [("nope",), (("a", "nope"),)])
def test_a_key_that_is_not_a_parameter_is_named(tmp_path, keys):
    (tmp_path / "test_m.py").write_text(f'''
import pytest

@pytest.mark.sample(*{keys!r})
@pytest.mark.parametrize("a", [1, 2])
def test_x(a):
    pass
''')
    code, _, out = _collected(tmp_path)
    assert code != 0 and "'nope'" in out and "test_x" in out
