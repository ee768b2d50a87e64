"""Grading's limits, in one place for the command line and the grader.

Grading a solved learner's labs 00-05 (hidden checks included) takes 23 s on a 2-core machine, running
the six solved notebooks 281 s (``LABLIB_QUICK=1``; ``python -m lablib.bench --only P2,P8``): the notebooks
measure, grading only checks. A learner's limit is about 7 times the solved grading time, room for
slower code and a slower machine; each check has its own limit besides.
"""
CHECK_TIMEOUT = 30.0   # seconds for one check's collect step in the box (a check takes a few seconds)
TIME_LIMIT = 165.0     # seconds for one learner's box (its labs; lab 08 has its own): about 6 x a solved learner's grading
SCRATCH_BYTES = 512 << 20   # what one grading box may write (a private tmpfs: its folder and its /tmp)
RESULTS_BYTES = 64 << 20    # what one grading box may hand back over its pipe (a lab's results are a few MB)
