"""Start and stop agents as detached processes, where there is no systemd (as on these sandboxes).

Double fork, setsid, stdio to /dev/null (stdout/stderr appended to
``<log_dir>/agent-<stem>.log`` when it can be opened), then exec
``<command> --host-config PATH --domain NAME``. The agent inherits an open,
``flock``-ed ``<agents_dir>/<stem>.pid`` that holds its pid: the lock lives
exactly as long as the agent, so a second start is a no-op and a stale
pidfile is never mistaken for a live agent. The agent learns the descriptor
and path from ``VMCACHE_PIDFILE_FD`` and ``VMCACHE_PIDFILE`` and removes the
pidfile as it exits (:func:`remove_own_pidfile`), still holding the lock; a
start that locked a pidfile removed under it sees that (inode check) and
opens it anew. Stop sends SIGTERM to that pid if the lock is held and
/proc/PID/cmdline ends with ``--domain NAME``, and does not wait.

Each agent follows one *run* of its domain (``--domain-id N``, libvirt's
id of the run the hook saw start). A start for a new run that finds the
previous run's agent still holding the lock (``virsh destroy; virsh
start`` in a row: it is still cleaning up) sends that agent SIGTERM and
starts the new one as a *successor*: it waits for the lock itself
(:func:`wait_for_pidfile`), so the hook still returns at once and the new
run still gets exactly one agent.

Used by the libvirt hook: imports nothing heavy, never calls libvirt.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable, Sequence

from ..errors import HostError
from ..host.files import file_stem, lock_holder, names_fd, pid_in, try_lock
from ..host.procs import cmdline
from .launchresult import LaunchResult

__all__ = ["DetachedLauncher", "pidfile_path", "remove_own_pidfile", "wait_for_pidfile"]

_LOCK_ATTEMPTS = 5
_LOCK_RETRY_SECONDS = 0.01
PIDFILE_ENV = "VMCACHE_PIDFILE"
PIDFILE_FD_ENV = "VMCACHE_PIDFILE_FD"
PIDFILE_WAIT_ENV = "VMCACHE_PIDFILE_WAIT"
#: How long a successor waits for the previous agent before SIGKILLing it, and before giving up.
SUCCESSOR_GRACE_SECONDS = 30.0
SUCCESSOR_GIVE_UP_SECONDS = 60.0


def pidfile_path(agents_dir: str, domain: str) -> str:
    """The pidfile of ``domain``'s detached agent in ``agents_dir``."""
    return os.path.join(agents_dir, file_stem(domain) + ".pid")


class DetachedLauncher:
    """Starts agents as detached processes guarded by flock-ed pidfiles in ``agents_dir``."""

    def __init__(self, command: Sequence[str], agents_dir: str, *, log_dir: str | None = None,
                 proc: str = "/proc") -> None:
        if not command:
            raise ValueError("empty agent command")
        self.command = tuple(command)
        self.agents_dir = agents_dir
        self.log_dir = log_dir
        self._proc = proc

    def pidfile(self, domain: str) -> str:
        return pidfile_path(self.agents_dir, domain)

    def argv(self, domain: str, domain_id: int | None = None) -> list[str]:
        run = ["--domain-id", str(domain_id)] if domain_id is not None else []
        return [*self.command, *run, "--domain", domain]

    def running(self, domain: str) -> int | None:
        """The pid of the domain's agent if one runs (holds the pidfile lock), else None.

        0 means an agent is being started and has not recorded its pid yet.
        """
        return lock_holder(self.pidfile(domain))

    def start(self, domain: str, domain_id: int | None = None) -> LaunchResult:
        """Start the agent of run ``domain_id`` unless one runs; returns once it is exec'd. Raises HostError.

        An agent of another run holding the lock is asked to stop, and the
        new one started as its successor (``started-after``).
        """
        path = self.pidfile(domain)
        try:
            os.makedirs(self.agents_dir, mode=0o755, exist_ok=True)
        except OSError as err:
            raise HostError(f"cannot open pidfile: {err.strerror}", path=path, errno=err.errno) from err
        for attempt in range(_LOCK_ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as err:
                raise HostError(f"cannot open pidfile: {err.strerror}", path=path, errno=err.errno) from err
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = _pread_pid(fd)
                    # An agent holds it - or a reader (running()) for a moment: look again.
                    if pid and self._is_agent(pid, domain):
                        if domain_id is None or _run_of(cmdline(pid, proc=self._proc)) == domain_id:
                            return LaunchResult("already-running", domain, pid=pid)
                        return self._succeed(pid, domain, domain_id, path)
                    if attempt == _LOCK_ATTEMPTS - 1:
                        return LaunchResult("already-running", domain, pid=pid)
                    time.sleep(_LOCK_RETRY_SECONDS)
                    continue
                if not names_fd(path, fd):
                    continue  # an exiting agent removed it after we opened it: open the new one
                pid = self._spawn(self.argv(domain, domain_id), fd, path, self._log_path(domain))
                return LaunchResult("started", domain, pid=pid)
            finally:
                os.close(fd)  # the agent keeps its own copy of the locked description
        raise HostError("pidfile kept being replaced while starting the agent", path=path)

    def _succeed(self, old: int, domain: str, domain_id: int, path: str) -> LaunchResult:
        """Stop ``old`` (another run's agent) and start the new run's agent, which waits for the lock."""
        try:
            os.kill(old, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except OSError as err:
            raise HostError(f"cannot signal agent {old}: {err.strerror}", errno=err.errno) from err
        pid = self._spawn(self.argv(domain, domain_id), -1, path, self._log_path(domain))
        return LaunchResult("started-after", domain, pid=pid, detail=f"previous run's agent {old} stopping")

    def _is_agent(self, pid: int, domain: str) -> bool:
        return _agent_of(cmdline(pid, proc=self._proc), domain)

    def stop(self, domain: str) -> LaunchResult:
        """SIGTERM the domain's agent if it runs and is ours; does not wait. Raises HostError."""
        pid = self.running(domain)
        if pid is None:
            return LaunchResult("not-running", domain)
        if pid == 0:
            return LaunchResult("starting", domain, detail="pid not recorded yet")
        argv = cmdline(pid, proc=self._proc)
        if argv is None:
            return LaunchResult("not-running", domain, pid=pid)
        if not _agent_of(argv, domain):
            return LaunchResult("not-ours", domain, pid=pid, detail=" ".join(argv)[:200])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return LaunchResult("not-running", domain, pid=pid)
        except OSError as err:
            raise HostError(f"cannot signal agent {pid}: {err.strerror}", errno=err.errno) from err
        return LaunchResult("stopping", domain, pid=pid)

    def _log_path(self, domain: str) -> str | None:
        if self.log_dir is None:
            return None
        return os.path.join(self.log_dir, f"agent-{file_stem(domain)}.log")

    def _spawn(self, argv: list[str], lock_fd: int, pidfile: str, log_path: str | None) -> int:
        """Double fork + setsid + exec ``argv``; the grandchild inherits ``lock_fd`` and writes its pid there.

        ``lock_fd`` -1: a successor, which takes the lock on ``pidfile`` itself (:func:`wait_for_pidfile`).
        """
        log_fd = -1
        if log_path is not None:
            try:
                os.makedirs(os.path.dirname(log_path), mode=0o755, exist_ok=True)
                log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            except OSError:
                log_fd = -1  # the agent's output goes to /dev/null then
        null_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            child = os.fork()
            if child == 0:  # pragma: no cover - runs in the forked process, tested through its effects
                _detached_child(argv, lock_fd, pidfile, null_fd, log_fd if log_fd >= 0 else null_fd, report_w)
            os.close(report_w)
            report_w = -1
            os.waitpid(child, 0)  # the intermediate exits at once
            report = _read_all(report_r)
        finally:
            for fd in (report_r, report_w, null_fd, log_fd):
                if fd >= 0:
                    os.close(fd)
        lines = dict(line.partition(" ")[::2] for line in report.decode("ascii", "replace").splitlines())
        if "exec-error" in lines:
            err_no = int(lines["exec-error"])
            raise HostError(f"cannot run agent {argv[0]}: {os.strerror(err_no)}", path=argv[0], errno=err_no)
        if "pid" not in lines:
            raise HostError(f"agent did not start: {report!r}", path=argv[0])
        return int(lines["pid"])


def _detached_child(argv: list[str], lock_fd: int, pidfile: str, null_fd: int, out_fd: int,  # pragma: no cover
                    report_w: int) -> None:
    """In the first child: setsid, fork again, and exec ``argv`` in the grandchild. Never returns."""
    code = 0
    try:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.chdir("/")
        os.umask(0o022)
        os.dup2(null_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        keep = [report_w]
        if lock_fd >= 0:
            os.set_inheritable(lock_fd, True)
            keep.append(lock_fd)
        low = 3
        for fd in sorted(keep):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        pid = os.getpid()
        os.environ[PIDFILE_ENV] = pidfile
        if lock_fd >= 0:
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, f"{pid}\n".encode(), 0)
            os.environ[PIDFILE_FD_ENV] = str(lock_fd)
        else:
            os.environ[PIDFILE_WAIT_ENV] = "1"
        os.write(report_w, f"pid {pid}".encode())
        try:
            os.execvp(argv[0], argv)
        except OSError as err:
            if lock_fd >= 0:
                os.ftruncate(lock_fd, 0)
            os.write(report_w, f"\nexec-error {err.errno}".encode())
            code = 127
    except BaseException:  # noqa: BLE001 - a forked child must never return into the caller
        code = 126
    os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _agent_of(argv: list[str] | None, domain: str) -> bool:
    """Whether ``argv`` is the command line of ``domain``'s agent (the launcher's argv ends ``--domain NAME``)."""
    return argv is not None and argv[-2:] == ["--domain", domain]


def _pread_pid(fd: int) -> int | None:
    try:
        return pid_in(os.pread(fd, 32, 0))
    except OSError:
        return None


def _run_of(argv: list[str] | None) -> int | None:
    """The ``--domain-id`` an agent's command line names (None: none, or not a number)."""
    if not argv or "--domain-id" not in argv[:-1]:
        return None
    value = argv[argv.index("--domain-id") + 1]
    return int(value) if value.isdigit() else None


def wait_for_pidfile(domain: str, domain_id: int | None, environ: dict[str, str] | None = None, *, proc: str = "/proc",
                     grace: float = SUCCESSOR_GRACE_SECONDS, give_up: float = SUCCESSOR_GIVE_UP_SECONDS,
                     clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """In a successor agent (:meth:`DetachedLauncher.start`): take the pidfile lock once the previous agent left it.

    The previous agent was sent SIGTERM; still there after ``grace`` s (and
    still an agent of another run of ``domain``), it gets SIGKILL. Records
    this process's pid, and the descriptor for :func:`remove_own_pidfile`.
    False (a no-op) outside a successor. Raises HostError when the pidfile
    cannot be opened, an agent of run ``domain_id`` holds it already, or
    the lock was not free within ``give_up`` s.
    """
    env = os.environ if environ is None else environ
    path = env.get(PIDFILE_ENV)
    if not path or env.get(PIDFILE_WAIT_ENV) != "1":
        return False
    started, killed = clock(), False
    while True:
        try:
            fd, owner = try_lock(path, f"{os.getpid()}\n".encode())
        except OSError as err:
            raise HostError(f"cannot open pidfile: {err.strerror}", path=path, errno=err.errno) from err
        if fd is not None:
            env[PIDFILE_FD_ENV] = str(fd)
            env.pop(PIDFILE_WAIT_ENV, None)
            return True
        holder = pid_in(owner)
        argv = cmdline(holder, proc=proc) if holder else None
        ours = _agent_of(argv, domain)
        if ours and domain_id is not None and _run_of(argv) == domain_id:
            raise HostError(f"agent {holder} already follows run {domain_id}", path=path)
        waited = clock() - started
        if waited > give_up:
            raise HostError(f"the previous agent ({holder}) kept the pidfile lock for {give_up:g} s", path=path)
        if waited > grace and ours and holder and not killed:
            _kill(holder)
            killed = True
        sleep(0.05)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def remove_own_pidfile(environ: dict[str, str] | None = None) -> bool:
    """In an agent started by :class:`DetachedLauncher`, as it exits: remove its pidfile.

    Unlinked while the inherited lock is still held, and only if the path
    still names the locked file, so it can never remove another agent's.
    True if it was removed; a no-op (False) outside such an agent.
    """
    env = os.environ if environ is None else environ
    path, fd_text = env.get(PIDFILE_ENV), env.get(PIDFILE_FD_ENV)
    if not path or not fd_text or not fd_text.isdigit():
        return False
    fd = int(fd_text)
    if not names_fd(path, fd):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: succeeds unless the fd is not the lock
        os.unlink(path)
    except OSError:
        return False
    return True

