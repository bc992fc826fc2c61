"""tools/step_walk.py: the calls of one step and one released backward between fastoptim's modules."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("step_walk", os.path.join(ROOT, "tools", "step_walk.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_and_a_released_bucket_call_only_down_from_the_optimizer():
    """Both walks go through the stepper; neither calls back up from the engine or a path into the optimizer."""
    walk = _tool().walk
    for release in (False, True):
        calls, modules = walk(release)
        assert "engine/stepper.py" in modules and "paths/cpu_kernel/__init__.py" in modules, modules
        upward = [c for c in calls if c.startswith(("engine/", "paths/")) and "-> optimizer.py" in c]
        assert not upward, upward
        if release:
            assert "engine/release.py -> engine/stepper.py: step_params" in calls, calls
