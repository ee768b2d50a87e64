"""The pool inside a real Jupyter kernel: the %%ranks magic, the stop button, a kernel crash."""
import os
import time

import pytest
from jupyter_client.manager import start_new_kernel
from procs import HUNG, wait_gone


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def _execute(kc, code, timeout=120):
    """Run a cell; return (reply content, stdout, stderr, display data list)."""
    msg_id = kc.execute(code)
    out, err, data = [], [], []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            (out if content["name"] == "stdout" else err).append(content["text"])
        elif kind in ("execute_result", "display_data"):
            data.append(content["data"])
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:  # skip stray replies (a slow kernel answers start-up's repeated kernel_info requests late)
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(out), "".join(err), data


def test_ranks_magic_runs_the_cell_on_n_ranks_with_notebook_variables(kernel):
    km, kc = kernel
    reply, *_ = _execute(kc, "import lablib\n%load_ext lablib\nbase = 10\ndef plus(x):\n    return x + base")
    assert reply["status"] == "ok"
    reply, out, err, data = _execute(kc, "%%ranks 3\nx = torch.ones(1) * rank\ndist.all_reduce(x)\n"
                                         "print('sum', x.item(), 'of', world_size)\nplus(rank)")
    assert reply["status"] == "ok", reply
    for r in range(3):
        assert f"[rank {r}] sum 3.0 of 3\n" in out
    assert data[-1]["text/plain"] == "[10, 11, 12]"
    reply, out, err, data = _execute(kc, "%%ranks 3 --timeline\nwith lablib.span('work'):\n    pass")
    assert reply["status"] == "ok"
    assert "application/vnd.plotly.v1+json" in data[-1]


def test_ranks_magic_reports_a_rank_error_with_the_cell_line(kernel):
    km, kc = kernel
    reply, *_ = _execute(kc, "%%ranks 2\nif rank == 1:\n    raise KeyError('missing shard')")
    assert reply["status"] == "error" and reply["ename"] == "RankError"
    assert "rank 1 of 2 failed: KeyError: 'missing shard'" in reply["evalue"]
    assert "raise KeyError('missing shard')" in reply["evalue"]  # the cell's source line, quoted


def test_a_rank_traceback_names_the_notebook_cell(kernel):
    km, kc = kernel
    reply, *_ = _execute(kc, "import lablib\ndef boom():\n    raise KeyError('missing shard')")
    assert reply["status"] == "ok"
    reply, *_ = _execute(kc, "lablib.cluster(2).run(boom)")
    assert reply["status"] == "error" and reply["ename"] == "RankError"
    assert f"Cell In[{reply['execution_count'] - 1}], line 3, in boom" in reply["evalue"], reply["evalue"]
    assert "ipykernel_" not in reply["evalue"]


def test_stop_button_interrupts_every_rank_and_the_next_run_works(kernel):
    km, kc = kernel
    _execute(kc, "c = lablib.cluster(2)\nimport time, torch, torch.distributed as dist\n"
                 "def stuck():\n    if dist.get_rank() == 0:\n        time.sleep(3600)\n    dist.all_reduce(torch.ones(1))")
    msg_id = kc.execute("c.run(stuck)")
    time.sleep(1.0)
    t = time.monotonic()
    km.interrupt_kernel()
    while True:
        reply = kc.get_shell_msg(timeout=HUNG)
        if reply["parent_header"]["msg_id"] == msg_id:
            break
    assert time.monotonic() - t < HUNG
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    reply, out, *_ = _execute(kc, "print(c.run(lambda: 5))")
    assert reply["status"] == "ok" and "[5, 5]" in out


def test_a_failed_check_shows_its_message_not_lablib_source(kernel):
    km, kc = kernel
    reply, *_ = _execute(kc, "from lablib.checks.lab01 import check_flat_shard\n"
                             "def chunked(flat, n, rank):\n"
                             "    return flat.chunk(n)[rank]\n"
                             "check_flat_shard(chunked)")
    assert reply["status"] == "error" and reply["ename"] == "CheckFailed"
    shown = "\n".join(reply["traceback"])
    assert "Task 1.1" in shown and "pad first, then slice" in shown
    assert "lablib/checks" not in shown and "call_local(" not in shown  # no frames of the check itself


def test_a_killed_kernel_leaves_no_rank_behind(kernel):
    km, kc = kernel
    reply, out, *_ = _execute(kc, "print(*lablib.cluster(2).pids())")
    pids = [int(p) for p in out.split()]
    assert pids and all(os.path.exists(f"/proc/{p}") for p in pids)
    km.shutdown_kernel(now=True)  # SIGKILL, as a crash or a forced restart does
    assert wait_gone(pids)

