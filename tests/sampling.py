"""The default test run's sample of the large matrices (pytest hooks; conftest.py takes them in).

A test marked ``@pytest.mark.sample(keys...)`` is a matrix the default run samples: of its cases it runs a few
that together take every value of each key, a key being a tuple of the test's parameter names (by default every
pair of them: pairwise coverage), on each device a matrix runs on. A test marked ``slow`` (tens of seconds: a torchrun launch of the README's
command, a tool run whole) is left to the full run too. ``--full`` runs every case; ``--rest`` only what the
default leaves out, so the default run and a ``--rest`` run check exactly what ``--full`` checks (CI runs both)."""

import itertools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("fastoptim")
    group.addoption("--full", action="store_true", help="run every case of the sampled matrices")
    group.addoption("--rest", action="store_true",
                    help="run only the cases of the sampled matrices that the default run leaves out")


def pytest_configure(config):
    config.addinivalue_line("markers", "sample(*keys): a matrix the default run samples (see tests/sampling.py)")
    config.addinivalue_line("markers", "slow: tens of seconds; run by --full and --rest, not by default")
    if config.getoption("full") and config.getoption("rest"):
        raise pytest.UsageError("--full runs every case and --rest only those the default leaves out: pick one")


def pytest_report_header(config):
    if config.getoption("full"):
        return "fastoptim: --full, every case of every matrix"
    if config.getoption("rest"):
        return "fastoptim: --rest, only the cases of the sampled matrices that the default run leaves out"
    return "fastoptim: the large matrices are sampled (every value of each key); --full runs every case"


def cover(rows, keys):
    """The indices of a few of ``rows`` (dicts of parameter values) that together take every value each key (a
    tuple of names) takes over all rows: greedy set cover. Among rows that cover as much, the one whose values the
    rows taken so far hold least (so the levels, option sets and names spread over the sample instead of piling
    on the first of each), then the earliest: the same rows every run."""
    wants = [{(key, tuple(repr(row[n]) for n in key)) for key in keys} for row in rows]
    values = [[(n, repr(v)) for n, v in row.items()] for row in rows]
    uncovered = set().union(*wants) if wants else set()
    chosen, used = [], {}
    while uncovered:
        best = max(range(len(rows)), key=lambda i: (len(wants[i] & uncovered),
                                                    -sum(used.get(v, 0) for v in values[i]), -i))
        chosen.append(best)
        uncovered -= wants[best]
        for v in values[best]:
            used[v] = used.get(v, 0) + 1
    return sorted(chosen)


def _params(item):
    params = getattr(getattr(item, "callspec", None), "params", None)
    if params is None:
        raise pytest.UsageError(f"{item.nodeid}: marked sample, but it is not parametrized")
    return params


def pytest_collection_modifyitems(config, items):
    if config.getoption("full"):
        return
    matrices = {}
    for item in items:
        marker = item.get_closest_marker("sample")
        if marker is not None:
            matrices.setdefault(item.nodeid.split("[")[0], (marker, []))[1].append(item)
    left_out = {id(item) for item in items if item.get_closest_marker("slow") is not None}
    skipped = {id(item) for item in items if item.get_closest_marker("skip") is not None}
    for nodeid, (marker, cases) in matrices.items():
        names = sorted(_params(cases[0]))
        keys = [tuple(k) if isinstance(k, (tuple, list)) else (k,) for k in marker.args]
        keys = keys or (list(itertools.combinations(names, 2)) if len(names) > 1 else [tuple(names)])
        unknown = {n for key in keys for n in key} - set(names)
        if unknown:
            raise pytest.UsageError(f"{nodeid}: sample keys {sorted(unknown)} are not among its parameters {names}")
        # a case left out or skipped anyway covers nothing; each device (the CPU, CUDA) gets a sample of its own
        runnable = [case for case in cases if id(case) not in left_out and id(case) not in skipped]
        by_device = {}
        for case in runnable:
            by_device.setdefault(repr(_params(case).get("device")), []).append(case)
        for group in by_device.values():
            chosen = set(cover([_params(case) for case in group], keys))
            left_out |= {id(case) for i, case in enumerate(group) if i not in chosen}
    rest = config.getoption("rest")
    keep = [item for item in items if (id(item) in left_out) == rest]
    if len(keep) < len(items):
        kept = {id(item) for item in keep}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep
