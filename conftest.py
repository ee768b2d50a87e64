"""Settings for every test run, notebooks included (their kernels inherit the environment)."""
import os

# Labs measure less under test (e.g. lab 02 sweeps up to 4 MB, not 64 MB); the learner gets the full run.
os.environ.setdefault("LABLIB_QUICK", "1")
