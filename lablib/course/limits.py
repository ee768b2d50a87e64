"""Grading's time limits, in one place for the command line and the grader.

Grading a solved learner's labs 00-02 (hidden checks included) took 14 s on a 2-core machine, running
the three solved notebooks 98 s (``LABLIB_QUICK=1``); a learner's limit is that course run time x 1.2.
"""
CHECK_TIMEOUT = 30.0   # seconds for one check's collect step in the box (a check takes a few seconds)
TIME_LIMIT = 120.0     # seconds for one learner's box, every lab: 1.2 x the course's own run time
