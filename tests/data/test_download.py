"""Downloads: hash checks, mirror fallback, caching, atomic writes; a local server only."""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from xpnn.data import default_cache_dir, download, fetch
from xpnn.errors import UserError

PAYLOAD = b"\x00\x00\x08\x01\x00\x00\x00\x05" + bytes(range(5))
NAME = "labels-idx1-ubyte.gz"
GOOD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


class Server:
    """A static file server on 127.0.0.1 in a thread, counting the requests it gets."""

    def __init__(self, root: Path, behaviour: str = "files") -> None:
        self.requests: list[str] = []
        self.closing = threading.Event()
        handler = functools.partial(_Handler, self, behaviour, directory=str(root))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/files/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, server: Server, behaviour: str, *args, **kwargs) -> None:
        self.owner, self.behaviour = server, behaviour
        super().__init__(*args, **kwargs)

    def translate_path(self, path: str) -> str:
        return super().translate_path(path.removeprefix("/files"))

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.owner.requests.append(self.path)
        if self.behaviour == "short":  # promise more bytes than are sent, then hang up
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(PAYLOAD)
            self.close_connection = True
        elif self.behaviour == "silent":  # accept, then never answer
            self.owner.closing.wait(10)
        elif self.behaviour == "trickle":  # a byte every 0.05 s: no read ever times out
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(200):
                if self.owner.closing.wait(0.05):
                    break
                self.wfile.write(b"x")
                self.wfile.flush()
        else:
            super().do_GET()

    def log_message(self, format: str, *args) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    """serve(files={name: bytes}, behaviour=...) -> a running Server; all closed afterwards."""
    servers: list[Server] = []

    def start(files: dict[str, bytes] | None = None, behaviour: str = "files") -> Server:
        root = tmp_path / f"www{len(servers)}"
        root.mkdir()
        for name, data in (files or {}).items():
            (root / name).write_bytes(data)
        servers.append(Server(root, behaviour))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def dead_url() -> str:
    """A URL on a port nobody listens on: connection refused, no network involved."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_download_is_cached_and_reused(serve, tmp_path: Path) -> None:
    server = serve({NAME: PAYLOAD})
    cache = tmp_path / "cache"
    path = fetch(NAME, GOOD_SHA, [server.url], cache)
    assert path == cache / NAME and path.read_bytes() == PAYLOAD
    assert server.requests == ["/files/" + NAME]
    assert fetch(NAME, GOOD_SHA, [server.url], cache) == path
    assert len(server.requests) == 1  # the second call never asked
    assert listing(cache) == [NAME]  # no temporary files left behind


def test_cached_copy_needs_no_mirror(tmp_path: Path) -> None:
    (tmp_path / NAME).write_bytes(PAYLOAD)
    assert fetch(NAME, GOOD_SHA, [], tmp_path) == tmp_path / NAME


def test_cached_copy_with_another_hash_is_refused_and_kept(serve, tmp_path: Path) -> None:
    """Downloads land only after their hash is checked, so a cached file that fails it is
    someone else's (put there or changed): theirs to replace, not xpnn's to delete or overwrite."""
    server = serve({NAME: PAYLOAD})
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / NAME).write_bytes(b"garbage")
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, [server.url], cache)
    bad_sha = hashlib.sha256(b"garbage").hexdigest()
    assert str(info.value) == (
        f"{cache / NAME}: the cached file's SHA-256 is {bad_sha[:12]}..., not the expected "
        f"{GOOD_SHA[:12]}...; remove or replace it"
    )
    assert (cache / NAME).read_bytes() == b"garbage"
    assert server.requests == []  # nothing downloaded to overwrite it with
    assert listing(cache) == [NAME]


def test_checksum_mismatch_rejected_and_nothing_cached(serve, tmp_path: Path) -> None:
    server = serve({NAME: PAYLOAD + b"tampered"})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, [server.url], cache)
    message = str(info.value)
    assert "\n" not in message and f"{server.url}{NAME}: sha256 mismatch" in message
    assert listing(cache) == []


def test_cached_copy_with_another_hash_is_kept_offline(tmp_path: Path) -> None:
    """Offline, the error names the hash, not the mirrors' "connection refused", and the file
    stays."""
    (tmp_path / NAME).write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"SHA-256 is [0-9a-f]{12}\.\.\., not the expected") as info:
        fetch(NAME, GOOD_SHA.upper(), [dead_url()], tmp_path)
    assert "connection refused" not in str(info.value)
    assert (tmp_path / NAME).read_bytes() == b"garbage"
    assert listing(tmp_path) == [NAME]


def test_cached_copy_is_checked_again_when_another_rank_renamed_a_good_one_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The file hashed may be replaced by another rank's verified download before the check
    ends: the good copy now in place is used, not refused."""
    target = tmp_path / NAME
    target.write_bytes(b"garbage")
    real, calls = download._hash_cached, []

    def then_another_rank_renames(path: Path):
        hashed = real(path)
        calls.append(hashed[0])
        if len(calls) == 1:
            good = tmp_path / ".other-rank.part"
            good.write_bytes(PAYLOAD)
            os.replace(good, target)
        return hashed

    monkeypatch.setattr(download, "_hash_cached", then_another_rank_renames)
    assert fetch(NAME, GOOD_SHA, [], tmp_path) == target
    assert calls == [hashlib.sha256(b"garbage").hexdigest(), GOOD_SHA]
    assert target.read_bytes() == PAYLOAD


def test_another_ranks_download_is_used_when_this_ranks_mirrors_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fails_while_another_rank_succeeds(url: str, sha256: str, target: Path, timeout: float):
        target.write_bytes(PAYLOAD)
        return "connection refused"

    monkeypatch.setattr(download, "_try_mirror", fails_while_another_rank_succeeds)
    assert fetch(NAME, GOOD_SHA, ["http://127.0.0.1:9/"], tmp_path).read_bytes() == PAYLOAD


@contextmanager
def fails_if_hung(seconds: int) -> Iterator[None]:
    """Fail rather than hang (opening a named pipe for reading waits for a writer)."""

    def hung(*_) -> None:
        raise TimeoutError("hung on the cache entry")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kind", ["directory", "named pipe", "broken link", "unreadable link"])
def test_something_else_in_place_of_a_cached_file_is_one_line_user_error(
    serve, tmp_path: Path, kind: str
) -> None:
    server = serve({NAME: PAYLOAD})
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / NAME
    expected = {
        "directory": "in the download cache but a directory, not a file; remove it",
        "named pipe": "in the download cache but a named pipe, not a file; remove it",
        "broken link": f"in the download cache but a symbolic link to {tmp_path / 'gone'}, "
        "which does not exist; remove or fix it",
        "unreadable link": "cannot read the cached download: Input/output error",
    }[kind]
    if kind == "directory":
        target.mkdir()
    elif kind == "named pipe":
        os.mkfifo(target)
    elif kind == "broken link":
        target.symlink_to(tmp_path / "gone")
    else:  # a "regular file" that fails every read, even as root
        target.symlink_to("/proc/self/mem")
    with fails_if_hung(20), pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, [server.url], cache)
    assert str(info.value) == f"{target}: {expected}"
    assert server.requests == []  # and nothing replaced it
    assert target.is_symlink() if "link" in kind else target.exists()
    assert listing(cache) == [NAME]  # no temporary file left either


def test_unreadable_cached_file_is_one_line_user_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """chmod 000 stops no one when the tests run as root, so the refusal is simulated."""
    target = tmp_path / NAME
    target.write_bytes(PAYLOAD)
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(path) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, [], tmp_path)
    assert str(info.value) == f"{target}: cannot read the cached download: Permission denied"


def test_mismatch_on_first_mirror_falls_back_to_second(serve, tmp_path: Path) -> None:
    bad, good = serve({NAME: b"wrong"}), serve({NAME: PAYLOAD})
    cache = tmp_path / "cache"
    assert fetch(NAME, GOOD_SHA, [bad.url, good.url], cache).read_bytes() == PAYLOAD
    assert len(bad.requests) == 1 and len(good.requests) == 1
    assert listing(cache) == [NAME]


def test_dead_first_mirror_falls_back(serve, tmp_path: Path) -> None:
    server = serve({NAME: PAYLOAD})
    mirror = server.url.rstrip("/")  # no trailing slash: the separator is added
    assert fetch(NAME, GOOD_SHA, [dead_url(), mirror], tmp_path).read_bytes() == PAYLOAD
    assert len(server.requests) == 1


def test_all_mirrors_dead_is_one_line_user_error(tmp_path: Path) -> None:
    mirrors = [dead_url(), dead_url()]
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, mirrors, cache)
    message = str(info.value)
    assert "\n" not in message and NAME in message
    for mirror in mirrors:
        assert f"{mirror}{NAME}: connection refused" in message
    assert listing(cache) == []


def test_each_failure_reason_reported(serve, tmp_path: Path) -> None:
    missing = serve({})  # 404
    short = serve(behaviour="short")
    mirrors = [missing.url, short.url, "nonsense-without-scheme"]
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, mirrors, cache)
    message = str(info.value)
    assert "\n" not in message
    assert f"{missing.url}{NAME}: HTTP 404" in message
    assert f"{short.url}{NAME}: connection closed early" in message
    assert "nonsense-without-scheme/" in message
    assert listing(cache) == []


def test_timeout_moves_on(serve, tmp_path: Path) -> None:
    silent, good = serve(behaviour="silent"), serve({NAME: PAYLOAD})
    path = fetch(NAME, GOOD_SHA, [silent.url, good.url], tmp_path, timeout=0.3)
    assert path.read_bytes() == PAYLOAD
    with pytest.raises(UserError, match=r"timed out after 0\.3 s"):
        fetch(NAME, "0" * 64, [silent.url], tmp_path / "other", timeout=0.3)


def test_trickling_mirror_is_cut_off(serve, tmp_path: Path) -> None:
    """Every read got a byte within the timeout, so the download took as long as the server
    liked (10 s here; forever from a stuck proxy), then failed as cut short."""
    trickle, good = serve(behaviour="trickle"), serve({NAME: PAYLOAD})
    start = time.monotonic()
    path = fetch(NAME, GOOD_SHA, [trickle.url, good.url], tmp_path / "cache", timeout=0.3)
    assert path.read_bytes() == PAYLOAD
    assert time.monotonic() - start < 5
    with pytest.raises(UserError, match=r": too slow: \d+ bytes in 0\.\d s, under the 16 KiB/s"):
        fetch(NAME, GOOD_SHA, [trickle.url], tmp_path / "other", timeout=0.3)
    assert listing(tmp_path / "other") == []


def test_missing_home_is_not_created_for_the_cache(
    serve, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HOME=/home/nobody-here (a service user's placeholder): mkdir -p made it."""
    home = tmp_path / "gone"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XPNN_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    server = serve({NAME: PAYLOAD})
    with pytest.raises(UserError) as info:
        fetch(NAME, GOOD_SHA, [server.url], default_cache_dir())
    assert str(info.value) == (
        f"{home}/.cache/xpnn: cannot use as download cache: $HOME ({home}) does not exist; "
        "set XPNN_DATA_HOME to a directory, or pass `data_dir`"
    )
    assert not home.exists() and server.requests == []
    home.mkdir()  # once it is there, the cache is made in it
    assert fetch(NAME, GOOD_SHA, [server.url], default_cache_dir()).read_bytes() == PAYLOAD


def test_dead_processes_partial_downloads_are_removed(serve, tmp_path: Path) -> None:
    """A rank killed mid-download (SIGKILL, the OOM killer) left .NAME.*.part for good."""
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    parts = {
        "dead": f".{NAME}.{host}.{dead}.k2j4.part",
        "live": f".{NAME}.{host}.{os.getppid()}.a8x1.part",  # another rank, downloading now
        "elsewhere": f".{NAME}.{host}-other-node.{dead}.q0p3.part",  # its own host's to judge
        "other file": f".other-{NAME}.{host}.{dead}.z9z9.part",
    }
    for name in parts.values():
        (cache / name).write_bytes(b"partial")
    fetch(NAME, GOOD_SHA, [serve({NAME: PAYLOAD}).url], cache)
    kept = [parts["live"], parts["elsewhere"], parts["other file"]]
    assert listing(cache) == sorted([NAME, *kept])


def test_no_mirrors_is_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no download mirrors"):
        fetch(NAME, GOOD_SHA, [], tmp_path)


@pytest.mark.parametrize(("cache", "message"), [
    ("/proc/xpnn-cache", "cannot use as download cache"),  # cannot be made, even by root
    ("/proc", "cannot write to download cache"),  # exists, takes no files
])  # fmt: skip
def test_unusable_cache_directory_is_one_line_user_error(cache: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        fetch(NAME, GOOD_SHA, ["http://127.0.0.1:9/"], Path(cache))
    assert "\n" not in str(info.value) and cache in str(info.value)


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XPNN_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "xpnn"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "xpnn"
    monkeypatch.setenv("XPNN_DATA_HOME", str(tmp_path / "data"))
    assert default_cache_dir() == tmp_path / "data"
