"""The schedules lab 05's validator (Task 5.3) is judged on: a fixed bank of valid and broken ones, each
with what is wrong with it in words, and, for hidden checks, schedules broken at random from a seed."""
from __future__ import annotations

import random

from . import answers


# -- Task 5.3: the validator ----------------------------------------------------------------------------------
def _broken(rng: random.Random):
    """A schedule with something wrong, or right: (schedule, m, v)."""
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved"])
    p, v = rng.randint(2, 4), rng.randint(2, 3) if name == "interleaved" else 1
    m = p * rng.randint(1, 2) if name == "interleaved" else rng.randint(2, 5)
    rows = [list(map(list, row)) for row in answers("lab05").SCHEDULES[name](p, m, v)]
    r = rng.randrange(p)
    what = rng.randrange(7)
    i, j = sorted(rng.sample(range(len(rows[r])), 2))
    if what == 0:
        rows[r][i], rows[r][j] = rows[r][j], rows[r][i]      # two actions swapped
    elif what == 1:
        rows[r].pop(i)                                      # one missing
    elif what == 2:
        rows[r].insert(j, list(rows[r][i]))                 # one twice
    elif what == 3:
        rows[r][i][2] = (rows[r][i][2] + 1) % (p * v)       # on the wrong rank
    elif what == 4:
        rows[r][i][1] = m                                   # a micro-batch out of range
    elif what == 5:
        rows[r][i][2] += p * v                              # a stage out of range
    return rows, m, v


def _validate_cases(seed):
    """[(schedule as lists, m, v), ...]: what the check gives the learner's validate (computed from lablib's
    schedules outside the grading box, ``Check.given``)."""
    cases = ([(s, m, v) for s, m, v, _ in _bank()] if seed is None else
             [_broken(random.Random(seed * 100 + k)) for k in range(16)])
    return [([[list(a) for a in row] for row in s], m, v) for s, m, v in cases]


def _bank():
    """The fixed cases: (schedule, m, v) and what is wrong with it, in words (the tests read them too)."""
    sc = answers("lab05")
    ok = [(sc.gpipe(2, 3), 3, 1, "GPipe, p=2, m=3"), (sc.one_f_one_b(4, 4), 4, 1, "1F1B, p=4, m=4"),
          (sc.interleaved(2, 4, 2), 4, 2, "interleaved, p=2, m=4, v=2"), (sc.zb_h1(3, 3), 3, 1, "ZB-H1, p=3, m=3")]
    g = [list(map(list, row)) for row in sc.gpipe(2, 2)]
    wrong_rank = [row[:] for row in g]
    wrong_rank[1] = wrong_rank[1][:1] + [["F", 1, 0]] + wrong_rank[1][2:]
    twice = [g[0] + [["B", 1, 0]], g[1]]
    missing = [g[0], [a for a in g[1] if a != ["B", 0, 1]]]
    deadlock = [[["F", 0, 0], ["B", 0, 0], ["F", 1, 0], ["B", 1, 0]], [["F", 0, 1], ["F", 1, 1], ["B", 0, 1], ["B", 1, 1]]]
    own = [g[0], [["B", 0, 1], ["F", 0, 1], ["F", 1, 1], ["B", 1, 1]]]
    w_first = [[list(a) for a in row] for row in sc.zb_h1(2, 2)]
    k = next(i for i, a in enumerate(w_first[1]) if a[0] == "W")
    w_first[1].insert(0, w_first[1].pop(k))
    # F2 is out of range (rule 1) at rank 1's action 1 and listed again (rule 2) at its action 4: the rules'
    # order decides which is named
    out_twice = [g[0], g[1][:1] + [["F", 2, 1]] + g[1][1:3] + [["F", 2, 1]] + g[1][3:]]
    bad = [(wrong_rank, 2, 1, "stage 0's forward listed on rank 1"), (twice, 2, 1, "a backward listed twice"),
           (missing, 2, 1, "a backward missing"), (deadlock, 2, 1, "a deadlock: each rank waits for the other"),
           (own, 2, 1, "a backward before its own forward"), (w_first, 2, 1, "a W before its B"),
           ([[["F", 0, 0], ["B", 2, 0]], [["F", 0, 1], ["B", 0, 1]]], 1, 1, "a micro-batch out of range"),
           (out_twice, 2, 1, "a micro-batch out of range, listed twice")]
    return ok + bad
