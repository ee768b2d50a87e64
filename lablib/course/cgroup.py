"""The child cgroups a box runs in (sandbox.py): its memory, process and CPU limits, its out-of-memory kills,
and what is left of it to kill. cgroup v2, or v1's memory, pids and cpu hierarchies; nothing where this
process may not make a child group."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

# How long killed processes may take to go; longer means the kernel is stuck (e.g. on a dead disk).
GONE_S = 30.0
CPU_PERIOD_US = 100_000  # the period a CPU quota is counted over


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n % (1 << 30) == 0 else f"{n / (1 << 20):.0f} MiB"


class _Cgroup:
    """Child cgroups that hold one run: one directory in cgroup v2, or one per v1 hierarchy (memory,
    pids). They set its limits, count its out-of-memory kills, and find what is left to kill."""

    def __init__(self, dirs: list[Path], files: dict[str, Path], enforced: list[str]):
        self.dirs, self.files, self.enforced = dirs, files, enforced

    @classmethod
    def make(cls, memory_bytes: int | None, processes: int | None, cpus: float | None = None) -> _Cgroup | None:
        """The cgroups for these limits (None: no limit; ``cpus``: CPU time, in cores' worth), or None where
        this process may not make them."""
        wanted = {"memory": memory_bytes, "pids": processes, "cpu": cpus}
        try:
            with open("/proc/self/cgroup") as own, open("/proc/self/mountinfo") as mounts:
                where = _cgroup_homes(own.read(), mounts.read())
        except OSError:
            return None
        name = f"lablib-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        made, files, enforced = [], {}, []
        for controller, value in wanted.items():
            if value is None or controller not in where:
                continue
            parent, version = where[controller]
            _remove_stale(parent)
            child = parent / name
            try:
                if version == "v2" and controller not in (parent / "cgroup.subtree_control").read_text().split():
                    if controller not in (parent / "cgroup.controllers").read_text().split():
                        continue
                    (parent / "cgroup.subtree_control").write_text(f"+{controller}")
                if child not in made:
                    child.mkdir()
                    made.append(child)
                if controller == "pids":
                    (child / "pids.max").write_text(str(value))
                    enforced.append(f"processes {value} (cgroup {version})")
                elif controller == "cpu":
                    quota = max(1000, round(value * CPU_PERIOD_US))
                    if version == "v2":
                        (child / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
                    else:
                        (child / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                        (child / "cpu.cfs_quota_us").write_text(str(quota))
                    enforced.append(f"CPU {value:g} core(s) (cgroup {version})")
                else:
                    limit, swap = (("memory.max", "memory.swap.max") if version == "v2" else
                                   ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
                    (child / limit).write_text(str(value))
                    if (child / swap).exists():  # no swapping past the limit
                        (child / swap).write_text("0" if version == "v2" else str(value))
                    enforced.append(f"memory {_size(value)} (cgroup {version})")
                    files["oom"] = child / ("memory.events" if version == "v2" else "memory.oom_control")
            except OSError:
                continue
        if not enforced:
            for child in made:
                child.rmdir()
            return None
        return cls(made, files, enforced)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        if "oom" not in self.files:
            return 0
        for line in self.files["oom"].read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self):
        """Kill whatever is still in the cgroups, wait until they are empty, and remove them."""
        end = time.monotonic() + GONE_S
        for d in self.dirs:
            while time.monotonic() < end:
                try:
                    pids = (d / "cgroup.procs").read_text().split()
                    if not pids:
                        d.rmdir()
                        break
                except FileNotFoundError:
                    break
                except OSError:  # busy: the last processes are still exiting
                    pids = []
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)


def _remove_stale(parent: Path):
    """Remove the empty cgroups left by graders that were killed: their pid (in the name) is gone, and
    they are over a minute old (a grader in another pid namespace may have just made one)."""
    for old in parent.glob("lablib-sandbox-*"):
        try:
            if not os.path.exists(f"/proc/{old.name.split('-')[2]}") and time.time() - old.stat().st_mtime > 60:
                old.rmdir()
        except OSError:  # still in use, or removed meanwhile
            pass


CONTROLLERS = ("memory", "pids", "cpu")


def _cgroup_homes(proc_cgroup: str, mountinfo: str) -> dict[str, tuple[Path, str]]:
    """Where to make a run's cgroup for "memory", "pids" and "cpu": (directory, "v1" or "v2"), from this process's
    /proc/self/cgroup and /proc/self/mountinfo. In v1, under this process's cgroup. In v2, beside it: a v2
    cgroup that holds processes cannot pass memory or pids limits to children (except at the root)."""
    own = [line.split(":", 2) for line in proc_cgroup.splitlines() if line.count(":") >= 2]
    homes = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        rest = fields[fields.index("-") + 1:]
        root, point, fstype, options = fields[3], fields[4], rest[0], rest[2].split(",")
        for _, controllers, path in own:
            relative = os.path.relpath(path, root)
            if relative.startswith(".."):  # this mount does not show our cgroup
                continue
            where = Path(point) / relative
            if fstype == "cgroup2" and controllers == "":
                home = where if path == "/" else where.parent
                for controller in CONTROLLERS:
                    homes.setdefault(controller, (home, "v2"))
            elif fstype == "cgroup":
                for controller in CONTROLLERS:
                    if controller in controllers.split(",") and controller in options:
                        homes[controller] = (where, "v1")  # a controller mounted in v1 is not in v2
    return homes
