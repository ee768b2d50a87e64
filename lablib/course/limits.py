"""Grading's time limits, in one place for the command line and the grader.

Grading a solved learner's labs 00-03 (hidden checks included) took 20 s on a 2-core machine, running
the four solved notebooks 137 s (``LABLIB_QUICK=1``; ``python -m lablib.bench --only P2,P8``); a
learner's limit is that course run time x 1.2.
"""
CHECK_TIMEOUT = 30.0   # seconds for one check's collect step in the box (a check takes a few seconds)
TIME_LIMIT = 165.0     # seconds for one learner's box, every lab: 1.2 x the course's own run time
