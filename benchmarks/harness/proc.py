"""``/proc`` probes, and the one definition of "CPU idle" (docs/benchmarks.md, "Method")."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: the idle rule: the next IDLE_WINDOW s add under IDLE_FRACTION of one core's time, in CPU
#: and in run-queue wait; samples every IDLE_INTERVAL s
IDLE_WINDOW, IDLE_FRACTION, IDLE_INTERVAL = 0.1, 0.05, 0.005
_NAMES = "ESTABLISHED SYN_SENT SYN_RECV FIN_WAIT1 FIN_WAIT2 TIME_WAIT CLOSE CLOSE_WAIT LAST_ACK LISTEN"
TCP_STATES = {f"{i:02X}": name for i, name in enumerate([*_NAMES.split(" "), "CLOSING"], start=1)}


def _stat(path: str) -> list[bytes]:
    """Fields 3… of a ``stat`` file (the command name, which may hold spaces, cut off)."""
    with open(path, "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads, also exited ones), in seconds."""
    fields = _stat(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_busy_seconds() -> float:
    """CPU time all cores spent busy (not idle, not waiting for I/O), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


def cpu_split(pids: Iterable[int]) -> tuple[float, float, float]:
    """CPU seconds so far of the servers ``pids``, of this process, and of everything else."""
    servers, me = sum(cpu_seconds(pid) for pid in pids), cpu_seconds(os.getpid())
    return servers, me, system_busy_seconds() - servers - me


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def thread_ids(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _per_thread(pid: int, name: str) -> list[bytes]:
    out = []
    for tid in thread_ids(pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/{name}", "rb") as f:
            out.append(f.read())  # (OSError: the thread exited meanwhile)
    return out


def thread_names(pid: int) -> list[str]:
    return [comm.decode(errors="replace").strip() for comm in _per_thread(pid, "comm")]


def runnable_threads(pid: int) -> int:
    return sum(s[s.rindex(b")") + 2 : s.rindex(b")") + 3] == b"R" for s in _per_thread(pid, "stat"))


def runqueue_wait_seconds(pid: int) -> float:
    """Time the live threads spent runnable but not running (``schedstat``, field 2)."""
    return sum(int(s.split()[1]) for s in _per_thread(pid, "schedstat") if len(s.split()) > 1) / 1e9


def fd_targets(pid: int) -> list[str]:
    """The process's open descriptors; a TCP socket with its state (``GONE``: in no kernel
    table any more, reset or aborted, but not closed by the process)."""
    states = {}
    for table in ("tcp", "tcp6", "unix"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if table == "unix":
                    states.setdefault(f"socket:[{fields[6]}]", "UNIX")
                else:
                    states[f"socket:[{fields[9]}]"] = TCP_STATES.get(fields[3], fields[3])
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            state = f" {states.get(target, 'GONE')}" if target.startswith("socket:") else ""
            targets.append(target + state)
    return targets


def tcp_tx_queue(local_port: int, remote_port: int) -> int | None:
    """``tx_queue`` (unsent or unacknowledged bytes) of 127.0.0.1:local ↔ 127.0.0.1:remote."""
    local, remote = f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            parts = line.split()
            if parts[1] == local and parts[2] == remote:
                return int(parts[4].split(":")[0], 16)
    return None


def unread_bytes(sock: socket.socket) -> int:
    """Bytes in a socket's kernel receive queue, not yet read (``FIONREAD``)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])


@dataclass
class Idle:
    after_s: float | None  # idle start − since; None: not idle within the cap
    cpu_s: float  # CPU time from ``since`` to the idle start (to the cap, if none)
    cpu_at_start: float  # the process's CPU time at the first sample


def wait_cpu_idle(pid: int, since: float, cap: float = 15.0) -> Idle:
    """Sample ``pid`` from now on until it is idle: the idle start is the first sample after
    which the next ``IDLE_WINDOW`` adds less than ``IDLE_FRACTION`` of a core's time in CPU
    *and* in run-queue wait (a starved busy process must not pass for idle)."""
    quiet = IDLE_FRACTION * IDLE_WINDOW
    times, cpus, waits = [time.perf_counter()], [cpu_seconds(pid)], [runqueue_wait_seconds(pid)]
    i = k = 0  # the candidate idle start; the first sample a window after it
    while True:
        while True:
            while k < len(times) and times[k] < times[i] + IDLE_WINDOW:
                k += 1
            if k == len(times):
                break
            if cpus[k] - cpus[i] < quiet and waits[k] - waits[i] < quiet:
                return Idle(max(0.0, times[i] - since), cpus[i] - cpus[0], cpus[0])
            i += 1
        if time.perf_counter() - since > cap + IDLE_WINDOW:
            return Idle(None, cpus[-1] - cpus[0], cpus[0])
        time.sleep(max(0.0, times[-1] + IDLE_INTERVAL - time.perf_counter()))
        times.append(time.perf_counter())
        cpus.append(cpu_seconds(pid))
        waits.append(runqueue_wait_seconds(pid))


class RunnableSampler:
    """Counts the runnable threads of ``pids`` every ``interval`` s, in a background thread."""

    def __init__(self, pids: list[int], interval: float = 0.1) -> None:
        self.pids, self.interval, self.counts = pids, interval, [0]
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.counts.clear()
        while not self._stop.wait(self.interval):
            self.counts.append(sum(runnable_threads(pid) for pid in self.pids))

    def __enter__(self) -> RunnableSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.counts = self.counts or [0]
