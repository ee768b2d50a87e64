"""Settings for every test run, notebooks included (their kernels inherit the environment), and the
order that lets the learner copies run beside the source notebooks."""
import os
import sys

# Labs measure less under test (e.g. lab 02 sweeps up to 4 MB, not 64 MB); the learner gets the full run.
os.environ.setdefault("LABLIB_QUICK", "1")
# A check whose task is not done yet fails its cell here (in a learner's notebook it prints and Run All
# goes on), so nbval and the tests see an untouched learner copy fail its checks.
os.environ.setdefault("LABLIB_STRICT", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))
import learner_copies  # noqa: E402 - the same module test_release.py imports


def pytest_collection_modifyitems(session, config, items):
    """The learner copies' checks go last, after the source notebooks, so that their runs (started with
    the first source notebook) overlap the sources' run instead of following it."""
    late = [item for item in items if item.nodeid.startswith(learner_copies.TESTS)]
    if late and any(item.nodeid.startswith("sources/") for item in items):
        items[:] = [item for item in items if not item.nodeid.startswith(learner_copies.TESTS)] + late


def pytest_runtest_setup(item):
    if item.nodeid.startswith("sources/") and any(i.nodeid.startswith(learner_copies.TESTS) for i in item.session.items):
        learner_copies.start()


def pytest_sessionfinish(session):
    learner_copies.stop()
