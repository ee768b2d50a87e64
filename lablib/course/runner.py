"""The grading box's supervisor: the one process in the box that holds the run's nonce and the pipe to grade.py.

    python -m lablib.course.runner < REQUEST      (results to the pipe whose fd is in LABLIB_RESULTS_FD)

It reads the request (JSON, from grade.py on standard input), keeps the nonce, and starts the executor
(executor.py: the learner's exercise code and the checks' collect step, and the ranks they start) as a new
process, handing it the rest of the request and a pipe of its own. Each line the executor writes is passed on to
grade.py under the nonce if it is a record of a call asked for (a second one too: grade.py marks that check
invalid), or of a cell's error; nothing else gets through. No exercise code runs here, and none can address this
process: the executor is a fresh program, not a fork, and holds neither the nonce nor this pipe. Nothing here
judges: grade.py does, outside.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def main() -> int:
    request = json.loads(sys.stdin.buffer.read())
    nonce = request.pop("nonce")
    out = os.fdopen(int(os.environ.pop("LABLIB_RESULTS_FD")), "w", encoding="utf-8")
    wanted = {call["id"] for lab in request["labs"] for call in lab["calls"]}
    cells = {(lab["lab"], cell["name"]) for lab in request["labs"] for cell in lab["cells"]}
    read, write = os.pipe()
    executor = subprocess.Popen([sys.executable, "-m", "lablib.course.executor"], stdin=subprocess.PIPE,
                                pass_fds=(write,), env={**os.environ, "LABLIB_RECORDS_FD": str(write)})
    os.close(write)
    try:
        executor.stdin.write(json.dumps(request).encode())
        executor.stdin.close()
    except BrokenPipeError:
        pass
    with os.fdopen(read, encoding="utf-8", errors="replace") as records, out:
        for line in records:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            asked = isinstance(record, dict) and (record.get("id") in wanted if "id" in record else
                                                  (record.get("lab"), record.get("cell")) in cells)
            if not asked:
                continue
            out.write(json.dumps({**record, "nonce": nonce}) + "\n")
            out.flush()
    code = executor.wait()
    return code if code >= 0 else 128 - code  # as a shell reports a signal


if __name__ == "__main__":
    sys.exit(main())
