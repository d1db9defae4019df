"""Datasets with data.download=true on a machine without network: refused in pre-flight in one line
(the URL, data.root, what to do), exit 2, nothing started or made; and a download that fails after
the run started still leaves a metrics.json saying so.

No test depends on this machine's network: urllib (torchvision's downloads, and pre-flight's check)
sends every request through the proxy that http_proxy/https_proxy name, and the tests point those at a
local port that refuses connections, or at one that accepts and hangs up."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import ddpexp

from .conftest import metrics, run_ddpexp
from .test_cli import refuse

PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")
NOT_PROXIED = ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY")
DOWNLOADS = [
    # (overrides, the URL the line names)
    (["data=mnist"], "https://ossci-datasets.s3.amazonaws.com/mnist/"),
    (["data=fashion_mnist"], "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"),
    (["data=cifar10", "model=resnet18", "model.cifar_stem=true"], "https://www.cs.toronto.edu/"),
    (["data=imdb", "model=embbag", "task=binary"], "https://ai.stanford.edu/"),
]


def proxy_env(port: int) -> dict[str, str]:
    return {name: f"http://127.0.0.1:{port}" for name in PROXY_VARIABLES}


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound (so nothing else takes it) but not listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def no_network(closed_port: int, monkeypatch: pytest.MonkeyPatch) -> int:
    for name, value in proxy_env(closed_port).items():
        monkeypatch.setenv(name, value)
    for name in NOT_PROXIED:
        monkeypatch.delenv(name, raising=False)
    return closed_port


@pytest.mark.parametrize(("overrides", "url"), DOWNLOADS, ids=[o[0] for o, _ in DOWNLOADS])
def test_a_download_without_network_is_refused_in_one_line(
    tmp_path: Path, monkeypatch, capsys, no_network: int, overrides: list[str], url: str
):
    line = refuse(tmp_path, monkeypatch, capsys, *overrides, "data.download=true")
    root = tmp_path / "data"  # data.root's default, relative to where the command runs
    assert "data.download" in line and url in line and str(root) in line, line
    assert f"127.0.0.1:{no_network}" in line and "Connection refused" in line, line
    assert "copy them into data.root=data as" in line and "data=synthetic" in line, line
    assert not root.exists()  # nothing left behind (refuse: the directory it ran in is empty)


def test_the_command_line_refuses_a_download_without_network(tmp_path: Path, closed_port: int):
    """As a user meets it: `python -m ddpexp data=mnist data.download=true`, exit 2, one line."""
    env = {**proxy_env(closed_port), **{name: "" for name in NOT_PROXIED}}
    result = run_ddpexp(tmp_path, "data=mnist", "data.download=true", env=env)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: data.download: mnist"), result.stderr
    assert "https://ossci-datasets.s3.amazonaws.com/mnist/" in lines[0] and "data.root=data" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def hanging_up_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A proxy that takes every connection and closes it at once: pre-flight reaches it, and the
    download itself then fails, after the run started."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    for name, value in proxy_env(port).items():
        monkeypatch.setenv(name, value)
    for name in NOT_PROXIED:
        monkeypatch.delenv(name, raising=False)
    yield port
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept() that close() alone would leave waiting
    server.close()
    thread.join()


def test_a_download_that_fails_after_the_start_leaves_a_failed_record(
    tmp_path: Path, monkeypatch, hanging_up_proxy: int
):
    """The download starts (its host took a connection in pre-flight) and fails in the run: the run
    directory exists, so it holds a metrics.json with status failed and the download's one line."""
    monkeypatch.chdir(tmp_path)
    result = ddpexp.run(["data=mnist", "data.download=true", "trainer.progress=false", "hydra.run.dir=run"])
    assert result.status == "failed" and result.exit_code == 2, result
    record = metrics(tmp_path / "run")
    assert record["status"] == "failed", record
    assert "mnist cannot be downloaded" in record["error"] and "data=synthetic" in record["error"], record
    assert record["facts"]["strategy"] == "single", record["facts"]
