"""Downloads into a cache, SHA-256 checked, each rank through a temporary file of its own."""

import contextlib
import glob
import hashlib
import http.client
import logging
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from xpnn.data.files import NotAFile, open_regular, pid_alive
from xpnn.errors import UserError

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_DOWNLOAD_BYTES = 256 << 20  # far above any file here (26 MB): cuts off an endless stream
MIN_BYTES_PER_S = 16 << 10


class BadTransfer(OSError):
    """The server hung up early, sent too much, or too slowly."""


def default_cache_dir() -> Path:
    """$XPNN_DATA_HOME, else $XDG_CACHE_HOME/xpnn (if absolute, as XDG asks), else ~/.cache/xpnn."""
    if home := os.environ.get("XPNN_DATA_HOME"):
        expanded = os.path.expanduser(home)  # Path.expanduser raises for ~nosuchuser
        if expanded.startswith("~"):
            user = expanded[1:].split("/", 1)[0] or "the current user"
            raise UserError(f"XPNN_DATA_HOME={home}: cannot expand ~: no home for {user}")
        return Path(expanded)
    xdg = os.path.expanduser(os.environ.get("XDG_CACHE_HOME", ""))
    if os.path.isabs(xdg):
        return Path(xdg) / "xpnn"
    home = os.environ.get("HOME", "")  # empty: the password database's (``Path.home()``: ``/``)
    if not home:
        with contextlib.suppress(ImportError, KeyError, OSError):
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        if not home or home == "/":
            raise UserError(
                "no download cache: $HOME is not set and this user has no home directory; "
                "set XPNN_DATA_HOME to a directory, or pass `data_dir`"
            )
    return Path(home) / ".cache" / "xpnn"


def mirrors_from(env: str, defaults: tuple[str, ...]) -> list[str]:
    """The comma-separated mirrors in ``$env`` (a local or institutional one), else ``defaults``."""
    return [m.strip() for m in os.environ.get(env, "").split(",") if m.strip()] or list(defaults)


def _digest(path: Path) -> tuple[str, os.stat_result]:
    fd, info = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        digest = hashlib.sha256()
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest(), info


def sha256_file(path: Path) -> str:
    return _digest(path)[0]


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror or exc})"
    if isinstance(exc, BadTransfer):
        return str(exc)
    if isinstance(exc, http.client.IncompleteRead):
        return f"connection closed early ({len(exc.partial)} bytes received)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _too_large(what: str) -> BadTransfer:
    return BadTransfer(f"{what}, more than the {MAX_DOWNLOAD_BYTES >> 20} MiB any file may have")


def _download_to(url: str, dest, timeout: float) -> str:
    """Stream ``url`` into ``dest``, its rate checked (a trickle trips no timeout); the SHA-256."""
    digest, received, start = hashlib.sha256(), 0, time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        announced = response.headers.get("Content-Length", "") or ""
        if announced.isdigit() and int(announced) > MAX_DOWNLOAD_BYTES:
            raise _too_large(f"announced {int(announced):,} bytes")
        while chunk := response.read1(CHUNK):
            digest.update(chunk)
            dest.write(chunk)
            received += len(chunk)
            if received > MAX_DOWNLOAD_BYTES:
                raise _too_large(f"sent over {received:,} bytes")
            elapsed = time.monotonic() - start
            if elapsed > timeout and received < MIN_BYTES_PER_S * elapsed:
                raise BadTransfer(
                    f"too slow: {received:,} bytes in {elapsed:.1f} s, under the "
                    f"{MIN_BYTES_PER_S >> 10} KiB/s a download must average"
                )
    if announced.isdigit() and received < int(announced):
        raise BadTransfer(f"connection closed early ({received} of {announced} bytes received)")
    return digest.hexdigest()


def _host_prefix(target: Path) -> str:
    return f".{target.name}.{socket.gethostname()}."


def remove_orphaned_parts(target: Path) -> None:
    """Delete the partial downloads of ``target`` by this host's dead processes."""
    mine = _host_prefix(target)
    for part in target.parent.glob(glob.escape(mine) + "*.part"):
        pid = part.name[len(mine) :].split(".", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):  # gone already, or another user's to remove
                part.unlink()


def _try_mirror(url: str, sha256: str, target: Path, timeout: float) -> str | None:
    """Fetch one URL into ``target`` atomically; None, or why it failed."""
    prefix = f"{_host_prefix(target)}{os.getpid()}."
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=".part")
    except OSError as exc:
        why = f"cannot write to download cache: {exc.strerror}"
        raise UserError(f"{target.parent}: {why}") from None
    try:
        with os.fdopen(fd, "wb") as dest:
            got = _download_to(url, dest, timeout)
        if got != sha256.lower():
            return f"sha256 mismatch (got {got[:12]}..., expected {sha256[:12]}...)"
        os.replace(tmp_name, target)
        return None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return _describe(exc, timeout)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


def _hash_cached(target: Path) -> tuple[str, os.stat_result] | None:
    """SHA-256 and identity of the file at ``target`` (None: nothing there)."""
    try:
        return _digest(target)
    except (FileNotFoundError, NotADirectoryError):
        if not target.is_symlink():
            return None  # nothing there (a cache directory that is a file: mkdir says so)
        why = f"in the download cache but a symbolic link to {os.readlink(target)}, which does "
        why += "not exist; remove or fix it"
    except NotAFile as exc:
        why = f"in the download cache but {exc}, not a file; remove it"
    except OSError as exc:
        why = f"cannot read the cached download: {exc.strerror or exc}"
    raise UserError(f"{target}: {why}")


def cached(target: Path, sha256: str) -> bool:
    """Whether ``target`` holds the file of ``sha256``; another file there is a UserError."""
    expected = sha256.lower()
    for _ in range(3):
        if (hashed := _hash_cached(target)) is None:
            return False
        got, info = hashed
        if got == expected:
            return True
        with contextlib.suppress(FileNotFoundError):  # else another rank's file: hash it again
            if os.path.samestat(os.stat(target), info):
                break
    raise UserError(
        f"{target}: the cached file's SHA-256 is {got[:12]}..., not the expected "
        f"{expected[:12]}...; remove or replace it"
    )


def fetch(
    filename: str, sha256: str, mirrors: list[str], cache_dir: Path, *, timeout: float = 30,
    download: bool = True, holding: str = "",
) -> Path:  # fmt: skip
    """``cache_dir/filename`` holding the file of ``sha256``, cached or from the first mirror
    (not ``download``: a ``UserError`` naming `data_dir` ``holding`` it)."""
    cache_dir = Path(cache_dir)
    target = cache_dir / filename
    if cached(target, sha256):  # another file there: a UserError of its own
        return target
    if not download:
        off = f"not in the download cache and downloading is off (pass `data_dir` {holding})"
        raise UserError(f"{target}: {off}")
    home = Path(os.environ.get("HOME") or ".")
    if not home.exists() and home in (cache_dir, *cache_dir.parents):  # it would make a home
        raise UserError(
            f"{cache_dir}: cannot use as download cache: $HOME ({home}) does not exist; set "
            "XPNN_DATA_HOME to a directory, or pass `data_dir`"
        )
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        with contextlib.suppress(OSError):  # unless it or a parent is there but no directory
            there = next((p for p in (cache_dir, *cache_dir.parents) if p.exists()), None)
            why = f"{there} is not a directory" if there and not there.is_dir() else why
        raise UserError(f"{cache_dir}: cannot use as download cache: {why}") from None
    if not mirrors:
        raise UserError(f"{target}: not in the cache and no download mirrors are configured")
    remove_orphaned_parts(target)
    failures = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + filename
        log.info("downloading %s", url)
        if (why := _try_mirror(url, sha256, target, timeout)) is None:
            return target
        failures.append(f"{url}: {why}")
    if cached(target, sha256):  # another rank's download landed meanwhile
        return target
    why = "; ".join(failures)
    raise UserError(
        f"could not download {filename} into {cache_dir}: {why}; offline, pass `data_dir` "
        f"holding {filename}"
    )
