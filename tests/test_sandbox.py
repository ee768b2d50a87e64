"""The grading box (lablib.course.sandbox): what the learner code can see, write and reach, its limits,
and that nothing it starts outlives it. The box tests skip where bubblewrap cannot run, unless
LABLIB_REQUIRE_SANDBOX=1 (as in CI), where that is a failure."""
import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from lablib.course import sandbox
from lablib.course.cgroup import _cgroup_homes
from procs import HUNG

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# What the grader shows the box: the virtual environment and the lablib package (installed editable).
READONLY = [Path(sys.prefix), REPO / "lablib"]


@pytest.fixture
def box(monkeypatch):
    """Runs in a real box: skips (or fails, with LABLIB_REQUIRE_SANDBOX=1) where bwrap cannot make one."""
    monkeypatch.delenv("LABLIB_SANDBOX", raising=False)
    usable, why = sandbox.available()
    if not usable:
        if os.environ.get("LABLIB_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"LABLIB_REQUIRE_SANDBOX=1 but there is no sandbox: {why}")
        pytest.skip(f"no sandbox here ({why}): install bubblewrap (apt-get install bubblewrap) to run this test")


@pytest.fixture(params=["cgroup", "no cgroup"])
def cgroup(request, monkeypatch):
    """Both ways of limiting: a cgroup where this process may make one, and without (rlimit, and only the
    pid namespace to end every process)."""
    if request.param == "no cgroup":
        monkeypatch.setattr(sandbox._Cgroup, "make", classmethod(lambda cls, memory_bytes, processes, cpus=None: None))
    return request.param


@pytest.fixture
def work(tmp_path):
    path = tmp_path / "work"
    path.mkdir()
    return path


def python(code, work, limits=sandbox.Limits(HUNG), **kwargs):
    return sandbox.run([PYTHON, "-c", code], workdir=work, readonly=READONLY, limits=limits, **kwargs)


def running(marker: str) -> list[int]:
    """Host pids whose command line carries ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


# A daemon: double fork, a new session, an empty environment, the marker in its command line. The
# launcher waits until the daemon has written its file, so the test knows it was running.
DAEMON = """
import os, sys, time
marker, started = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c",
                  "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(1000)", started, marker], {})
    os._exit(0)
while not os.path.exists(started):
    time.sleep(0.01)
"""


def test_gloo_all_reduce_between_two_processes_in_the_box(box, cgroup, work):
    """The real workload: torch, lablib (editable install), worker processes, a unix socket in /tmp,
    shared memory, and Gloo over TCP on 127.0.0.1."""
    (work / "job.py").write_text("""
import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
import lablib

def rank(r, port, shared):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    t = torch.tensor([r + 1.0])
    dist.all_reduce(t)
    shared[r] = t.item()
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(socket.AF_UNIX)
    s.bind("/tmp/lab.sock")
    s.listen()
    c = socket.socket(socket.AF_UNIX)
    c.connect("/tmp/lab.sock")
    c.sendall(b"ping")
    assert s.accept()[0].recv(4) == b"ping"
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    shared = torch.zeros(2).share_memory_()
    mp.spawn(rank, args=(port, shared), nprocs=2)
    print("sums", shared.tolist(), "lablib from", os.path.dirname(lablib.__file__))
""")
    result = sandbox.run([PYTHON, "job.py"], workdir=work, readonly=READONLY, limits=sandbox.Limits(HUNG))
    assert result.boxed and result.reason == "" and result.returncode == 0, result.output
    assert f"sums [3.0, 3.0] lablib from {REPO / 'lablib'}" in result.output


def test_the_box_sees_only_what_it_is_given(box, work, tmp_path):
    secret = tmp_path / "other-learner"
    secret.mkdir()
    (secret / "answers.json").write_text("{}")
    result = python(f"""
import os
print("answers", os.path.exists("{secret / 'answers.json'}"))
print("home", os.path.exists("/root/.bashrc"))
print("repo", sorted(os.listdir("{REPO}")))
print("pids", max(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("user", os.getuid(), [l for l in open("/proc/self/status") if l.startswith("CapEff")])
""", work)
    assert result.returncode == 0, result.output
    assert "answers False" in result.output and "home False" in result.output
    shown = sorted(p.name for p in READONLY if p.parent == REPO)  # not sources/, the gradebook, ...
    assert f"repo {shown!r}" in result.output
    assert int(result.output.split("pids ")[1].split()[0]) < 20  # its own pid namespace
    assert "user 65534 ['CapEff:\\t0000000000000000\\n']" in result.output


def test_it_writes_only_its_work_dir_and_private_tmp(box, work, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    result = python(f"""
for path in ["{work}/made", "/tmp/scratch", "/dev/shm/segment", "{outside}/made", "{REPO}/lablib/made",
             "/etc/made", "/usr/made", "/made", "/root/made"]:
    try:
        open(path, "w").write("x")
        print(path, "written")
    except OSError as exc:
        print(path, "refused", type(exc).__name__)
""", work)
    assert result.returncode == 0, result.output
    for path in [f"{work}/made", "/tmp/scratch", "/dev/shm/segment"]:
        assert f"{path} written" in result.output
    for path in [f"{outside}/made", f"{REPO}/lablib/made", "/etc/made", "/usr/made", "/made", "/root/made"]:
        assert f"{path} refused" in result.output
    assert (work / "made").read_text() == "x"
    assert not (outside / "made").exists() and not (REPO / "lablib" / "made").exists()
    assert not Path("/tmp/scratch").exists()


def test_an_overlay_shows_another_dir_read_only(box, work, tmp_path):
    keyless = tmp_path / "keyless"
    keyless.mkdir()
    (keyless / "welcome.yaml").write_text("no keys here")
    result = python(f"""
import os
print(sorted(os.listdir("{REPO}/quizzes")), open("{REPO}/quizzes/welcome.yaml").read())
try:
    open("{REPO}/quizzes/new.yaml", "w")
except OSError:
    print("read-only")
""", work, overlays={REPO / "quizzes": keyless})
    assert result.returncode == 0, result.output
    assert "['welcome.yaml'] no keys here" in result.output and "read-only" in result.output


def test_no_network_but_loopback(box, work):
    result = python("""
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=5)
    print("reached the internet")
except OSError as exc:
    print("refused:", exc)
print("interfaces", [name for _, name in socket.if_nameindex()])
""", work)
    assert result.returncode == 0, result.output
    assert "refused:" in result.output and "reached" not in result.output
    assert "interfaces ['lo']" in result.output


def test_the_environment_is_only_what_is_given(box, work, monkeypatch):
    monkeypatch.setenv("GRADER_SECRET", "s3cret")
    result = python("import json, os; print(json.dumps(dict(os.environ)))", work, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.output
    seen = json.loads(result.output)
    assert set(seen) == {"HOME", "LANG", "OMP_NUM_THREADS", "PATH", "PWD"}  # bwrap sets PWD
    assert seen["HOME"] == str(work) and seen["OMP_NUM_THREADS"] == "1"


def test_a_daemon_dies_when_the_command_ends(box, cgroup, work):
    marker = f"lablib-test-{uuid.uuid4().hex}"
    result = sandbox.run([PYTHON, "-c", DAEMON, marker, str(work / "started")], workdir=work, readonly=READONLY,
                         limits=sandbox.Limits(HUNG))
    assert result.returncode == 0 and result.reason == "", result.output
    assert (work / "started").exists()
    assert running(marker) == []


def test_the_timeout_kills_the_whole_box(box, cgroup, work):
    marker = f"lablib-test-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = sandbox.run(["sh", "-c", f'"{PYTHON}" -c "$1" {marker} {work}/started && echo up && exec sleep 1000',
                          "sh", DAEMON], workdir=work, readonly=READONLY, limits=sandbox.Limits(2))
    assert time.monotonic() - start < HUNG
    assert result.returncode is None and result.reason == "timed out after 2 s", result.output
    assert "up" in result.output and (work / "started").exists()
    assert running(marker) == []


def test_the_box_cannot_see_or_signal_the_grader(box, work):
    code = (f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\nexcept ProcessLookupError:\n"
            "    print('no such process')\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    result = python(code, work)
    assert result.returncode == 0 and "no such process" in result.output, result.output
    assert max(json.loads(result.output.strip().splitlines()[-1])) < 10  # only the box's own few processes


def test_a_signal_death_is_reported(box, work):
    result = sandbox.run(["sh", "-c", "kill -KILL $$"], workdir=work, limits=sandbox.Limits(HUNG))
    assert result.returncode == -9 and result.reason == "killed by signal 9 (SIGKILL)"


def test_the_process_limit_stops_a_fork_bomb(box, work):
    result = python("""
import os, time
started = 0
for _ in range(500):
    try:
        if os.fork() == 0:
            time.sleep(1000)
            os._exit(0)
    except OSError as exc:
        print("fork refused:", exc)
        break
    started += 1
print("started", started)
""", work, limits=sandbox.Limits(HUNG, processes=50))
    if not any(e.startswith("processes") for e in result.enforced):
        pytest.skip(f"no process limit here: it needs a cgroup this process may make (enforced: {result.enforced})")
    assert result.returncode == 0 and result.reason == "", result.output
    assert "fork refused" in result.output
    assert int(result.output.split("started")[-1]) < 50


def test_the_memory_limit_stops_an_allocation_twice_as_big(box, cgroup, work):
    result = python("""
block = b"x" * (2 << 30)
print("allocated", len(block))
""", work, limits=sandbox.Limits(HUNG, memory_bytes=1 << 30))
    assert any(e.startswith("memory 1 GiB") for e in result.enforced), result.enforced
    assert "allocated" not in result.output and result.returncode != 0
    assert result.reason == "killed: out of memory (1 GiB limit)" or "MemoryError" in result.output, result


def test_unboxed_the_timeout_still_kills_the_process_group(cgroup, work, monkeypatch):
    monkeypatch.setenv("LABLIB_SANDBOX", "off")
    marker = f"lablib-test-{uuid.uuid4().hex}"
    script = f'"{PYTHON}" -c "import time; time.sleep(1000)" {marker} & echo up; exec sleep 1000'
    result = sandbox.run(["sh", "-c", script], workdir=work, limits=sandbox.Limits(2))
    assert not result.boxed and result.returncode is None and result.reason == "timed out after 2 s"
    assert "up" in result.output
    assert "WITHOUT a sandbox: LABLIB_SANDBOX=off" in result.warning
    assert running(marker) == []


def test_without_bwrap_it_warns_or_refuses(work, monkeypatch):
    monkeypatch.setattr(sandbox, "_probe", (False, "bwrap is not installed"))
    monkeypatch.delenv("LABLIB_SANDBOX", raising=False)
    result = sandbox.run(["sh", "-c", "echo ran"], workdir=work, limits=sandbox.Limits(HUNG))
    assert not result.boxed and result.output == "ran\n" and result.returncode == 0
    assert result.warning.startswith("grading ran WITHOUT a sandbox: bwrap is not installed")
    assert "apt-get install bubblewrap" in result.warning
    monkeypatch.setenv("LABLIB_SANDBOX", "require")
    with pytest.raises(sandbox.SandboxError, match="bwrap is not installed"):
        sandbox.run(["true"], workdir=work, limits=sandbox.Limits(HUNG))


@pytest.mark.parametrize("proc_cgroup, mountinfo, homes", [
    # cgroup v2 under systemd: beside the session's scope, in the slice
    ("0::/user.slice/user-0.slice/session-3.scope\n",
     "35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
     {"memory": ("/sys/fs/cgroup/user.slice/user-0.slice", "v2"),
      "pids": ("/sys/fs/cgroup/user.slice/user-0.slice", "v2"), "cpu": ("/sys/fs/cgroup/user.slice/user-0.slice", "v2")}),
    # cgroup v2 at the root of the hierarchy: under it
    ("0::/\n", "35 24 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
     {"memory": ("/sys/fs/cgroup", "v2"), "pids": ("/sys/fs/cgroup", "v2"), "cpu": ("/sys/fs/cgroup", "v2")}),
    # hybrid: memory, pids and cpu in v1 hierarchies, a v2 one without them
    ("8:pids:/\n4:memory:/process_api/9c44\n1:cpu,cpuacct:/\n0::/\n",
     "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
     "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
     "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
     "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
     {"memory": ("/sys/fs/cgroup/memory/process_api/9c44", "v1"), "pids": ("/sys/fs/cgroup/pids", "v1"),
      "cpu": ("/sys/fs/cgroup/cpu,cpuacct", "v1")}),
    # v1 in a container that mounts its own cgroup as the hierarchy's root
    ("4:memory:/docker/ab12\n", "35 31 0:32 /docker/ab12 /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
     {"memory": ("/sys/fs/cgroup/memory", "v1")}),
])
def test_where_the_run_cgroup_is_made(proc_cgroup, mountinfo, homes):
    found = _cgroup_homes(proc_cgroup, mountinfo)
    assert {c: (str(d), v) for c, (d, v) in found.items()} == homes


FILL = """
import errno, os, sys
wrote = {}
for folder in (os.getcwd(), "/tmp", os.environ["HOME"], "/proc/1/cwd", "/dev/shm"):
    n = 0
    try:
        with open(os.path.join(folder, "fill"), "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20))
                f.flush()
                n += 1
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    wrote[folder] = n
os.write(int(os.environ["LABLIB_RESULTS_FD"]), repr(wrote).encode() + sys.stdin.buffer.read())
"""


def test_a_box_with_scratch_writes_into_a_capped_tmpfs_of_its_own_and_answers_over_the_pipe(box, work):
    """Its folder, /tmp and /dev/shm are private tmpfs of 8 MiB each: writing stops there (ENOSPC), the host folder
    stays empty (also through /proc/1/cwd, the box's init's folder), and what it reads on stdin and writes to
    the channel crosses no disk."""
    result = python(FILL, work, scratch=8 << 20, stdin=b" and the request", channel=1 << 10)
    assert result.returncode == 0, result.output
    wrote = result.data.decode()
    assert wrote.endswith(" and the request") and not result.data_over
    sizes = eval(wrote.split(" and")[0])  # {folder: MiB written before ENOSPC}
    assert sizes[str(work)] <= 8 and sizes["/tmp"] <= 8 and sizes["/dev/shm"] <= 8, sizes  # not the 64 MiB it tried
    assert list(work.iterdir()) == []  # nothing reached the host
    assert any("tmpfs" in e for e in result.enforced), result.enforced


def test_the_channel_keeps_its_cap_and_says_when_the_box_went_over(box, work):
    code = "import os\nos.write(int(os.environ['LABLIB_RESULTS_FD']), b'y' * 5000)"
    result = python(code, work, scratch=1 << 20, channel=1000)
    assert result.returncode == 0 and result.data == b"y" * 1000 and result.data_over


SPIN = """
import os, threading, time
def spin():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
threads = [threading.Thread(target=spin) for _ in range(os.cpu_count())]
start = time.monotonic()
for t in threads: t.start()
for t in threads: t.join()
cpu = os.times()
print(f"{(cpu.user + cpu.system) / (time.monotonic() - start):.2f}")
"""


def test_a_cpu_share_holds_a_box_that_spins_on_every_core(box, work):
    """Given half a core, a box spinning threads on every core gets about that: its CPU time over its wall
    time. Where this machine gives no cgroup cpu controller, the limit is not among those enforced."""
    result = python(SPIN, work, sandbox.Limits(HUNG, cpus=0.5))
    assert result.returncode == 0, result.output
    if not any(e.startswith("CPU 0.5 core") for e in result.enforced):
        pytest.skip(f"no cgroup cpu controller to delegate here: {result.enforced}")
    assert float(result.output.split()[-1]) < 0.8  # spinning on every core, it had half of one
