"""A throwaway PostgreSQL cluster with ``wal_level=logical`` for tests, the demo and benchmarks.

``EmbeddedPostgres`` runs ``initdb``/``pg_ctl`` from the server binaries it finds (``PATH``,
``pg_config --bindir`` or ``/usr/lib/postgresql/*/bin``), or, when ``SEQUIN_PG_VERSION`` (or the
``version`` field) names a major 12–18, from that version's binaries fetched by
``postgres_binaries``. ``initdb`` refuses to run as root, so
when this process is root the cluster is created and run as an unprivileged OS user. When
``SEQUIN_TEST_DSN`` is set, that server is used instead and nothing is started.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from devtools import postgres_binaries
from devtools.postgres_binaries import SERVER_BINARIES


class EmbeddedPostgresError(postgres_binaries.PostgresBinariesError):
    """Raised when no cluster can be started and no ``SEQUIN_TEST_DSN`` is given."""


def find_server_bindir() -> Path:
    """Return the folder holding ``initdb``/``pg_ctl``/``postgres``, newest version first."""
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
            candidates.append(Path(out.stdout.strip()))
        except (subprocess.CalledProcessError, OSError):
            pass

    def version_key(path: str) -> float:
        try:
            return float(Path(path).parent.name)
        except ValueError:
            return 0.0

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True)]
    for bindir in candidates:
        if all((bindir / name).exists() for name in SERVER_BINARIES):
            return bindir
    raise EmbeddedPostgresError(
        "No PostgreSQL server binaries (initdb, pg_ctl, postgres) found on PATH, via pg_config, "
        "or in /usr/lib/postgresql/*/bin. Install the server package (e.g. apt-get install "
        "postgresql) or set SEQUIN_TEST_DSN=postgresql://user@host:port/db pointing at a server "
        "with wal_level=logical."
    )


def kept_data_dir(parent: Path) -> Path:
    """The demo's kept cluster folder under ``parent``: ``pg`` for the system's server, ``pg16`` for
    ``SEQUIN_PG_VERSION=16`` (a data folder only starts with the major that created it)."""
    version = postgres_binaries.requested_version()
    return parent / ("pg" if version is None else f"pg{version.split('.')[0]}")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unprivileged_user() -> pwd.struct_passwd | None:
    """The OS user to run the server as when we are root (``initdb`` refuses root)."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("SEQUIN_PG_USER", ""), "postgres", "nobody"):
        if not name:
            continue
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise EmbeddedPostgresError("running as root and neither a 'postgres' nor a 'nobody' user exists")


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL cluster owned by this process (or an external one from ``SEQUIN_TEST_DSN``).

    Use as a context manager; ``dsn(dbname)`` gives a connection string to any database in it.
    ``data_dir`` defaults to a fresh temporary folder that is removed on ``stop()``; a given
    ``data_dir`` (the demo's ``./var/pg``) is reused across runs and kept. ``version`` picks the
    server (a major such as ``"16"``); ``None`` means ``SEQUIN_PG_VERSION``, else the system's.
    """

    data_dir: Path | None = None
    version: str | None = None
    wal_level: str = "logical"
    settings: dict[str, str] = field(default_factory=dict)
    use_env_dsn: bool = True
    port: int = 0
    _owned_dir: bool = False
    _started: bool = False
    _external_dsn: str | None = None
    _bindir: Path | None = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def external(self) -> bool:
        """True when an existing server from ``SEQUIN_TEST_DSN`` is used."""
        return self._external_dsn is not None

    @property
    def bindir(self) -> Path:
        """The folder of the server binaries this cluster runs (resolved, and fetched, once)."""
        if self._bindir is None:
            version = self.version or postgres_binaries.requested_version()
            self._bindir = postgres_binaries.server_bindir(version) if version else find_server_bindir()
        return self._bindir

    @property
    def major(self) -> int:
        """The server's major version (of ``SEQUIN_TEST_DSN``'s server when external)."""
        if self._external_dsn:
            with psycopg.connect(self._external_dsn) as conn:
                return conn.info.server_version // 10000
        return postgres_binaries.server_major(self.bindir)

    def start(self) -> None:
        """Start the cluster (or adopt ``SEQUIN_TEST_DSN``) and wait until it accepts connections."""
        env_dsn = os.environ.get("SEQUIN_TEST_DSN") if self.use_env_dsn else None
        if env_dsn:
            self._external_dsn = env_dsn
            return
        bindir = self.bindir
        user = _unprivileged_user()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="sequin-pg-"))
            self._owned_dir = True
        self.data_dir = Path(self.data_dir).absolute()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pgdata = self.data_dir / "data"
        run_kwargs: dict[str, object] = {}
        if user is not None:
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
            os.chmod(self.data_dir, 0o700)
            run_kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self._check_data_version(pgdata)
        if not (pgdata / "PG_VERSION").exists():
            self._run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(pgdata),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
                run_kwargs,
            )
        self.port = self.port or free_port()
        options = {
            "wal_level": self.wal_level,
            # one session cluster serves the whole suite: a slot per stream app and capture, and the
            # slots of module-scoped databases live until the session ends (64 ran out at 600 tests)
            "max_replication_slots": "256",
            "max_wal_senders": "64",
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.data_dir),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "256MB",
            "max_wal_size": "2GB",
            "wal_sender_timeout": "0",
            **self.settings,
        }
        opt_string = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._run(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(pgdata),
                "-l",
                str(self.data_dir / "server.log"),
                "-o",
                opt_string,
                "-w",
                "-t",
                "60",
                "start",
            ],
            run_kwargs,
        )
        self._started = True
        self._wait_ready()

    def _check_data_version(self, pgdata: Path) -> None:
        """A kept data folder made by another major cannot be started: say so plainly."""
        marker = pgdata / "PG_VERSION"
        if marker.exists() and int(marker.read_text().strip().split(".")[0]) != self.major:
            raise EmbeddedPostgresError(
                f"{pgdata} was created by PostgreSQL {marker.read_text().strip()}, but this server is "
                f"PostgreSQL {self.major}: remove {self.data_dir} or set SEQUIN_PG_VERSION to its major"
            )

    def _run(self, argv: list[str], run_kwargs: dict[str, object]) -> None:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=str(self.data_dir), **run_kwargs)  # type: ignore[call-overload]
        if result.returncode != 0:
            log = self.data_dir / "server.log" if self.data_dir else None
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise EmbeddedPostgresError(
                f"{Path(argv[0]).name} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}\n{tail}"
            )

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError as exc:
                last = exc
                time.sleep(0.1)
        raise EmbeddedPostgresError(f"server on port {self.port} did not accept connections: {last}")

    def dsn(self, dbname: str = "postgres") -> str:
        """Connection string for ``dbname`` in this cluster."""
        if self._external_dsn:
            return psycopg.conninfo.make_conninfo(self._external_dsn, dbname=dbname)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create (or recreate) database ``name`` and return its DSN; drops its slots first."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )  # DROP ... WITH (FORCE) is 13+
            conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {}").format(psycopg.sql.Identifier(name)))
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        return self.dsn(name)

    def restart(self, mode: str = "fast") -> None:
        """Restart the server (``fast`` or ``immediate``), keeping port and data."""
        if self.external:
            raise EmbeddedPostgresError("cannot restart an external server (SEQUIN_TEST_DSN)")
        self.stop(remove=False, mode=mode)
        self.start()

    def stop(self, remove: bool | None = None, mode: str = "fast") -> None:
        """Stop the server; remove its folder when this object created it."""
        if self._started and self.data_dir is not None:
            user = _unprivileged_user()
            run_kwargs: dict[str, object] = {}
            if user is not None:
                run_kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
            try:
                self._run(
                    [str(self.bindir / "pg_ctl"), "-D", str(self.data_dir / "data"), "-m", mode, "-w", "stop"],
                    run_kwargs,
                )
            except EmbeddedPostgresError:
                pass
            self._started = False
        if (self._owned_dir if remove is None else remove) and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
