"""Generation by an OpenAI-compatible server that users already run: vLLM, SGLang, llama.cpp.

Requests go to ``/v1/completions`` with the prompt as token ids, so the chat template is applied
here, by the target's own tokenizer, and a regenerated row renders exactly as `dflash extract`
will render it. A server that takes only text prompts (llama-cpp-python's) is sent the decoded
prompt instead, once a probe has shown its tokenizer gives back the same ids.

What can be checked, is, when the backend starts: that the server answers, which model it serves,
and, where it has a tokenize endpoint (vLLM's and llama.cpp's ``/tokenize``, llama-cpp-python's
``/extras/tokenize``), that it tokenizes probe texts (special tokens included) to the ids the
target's tokenizer gives. What cannot: that its weights are the target's (a quantized or another
checkpoint answers all the same), and, without such an endpoint, its tokenizer. `checks` says which.

Failures: a server that cannot be reached at start is one error within seconds. A request that
fails with a connection error, a timeout, 429 or 5xx is retried with exponential backoff; after
`retries` it completes with an error that a rerun may not meet (`Completion.retry`), so regen
leaves its part for the next run. Other 4xx answers are the request's own fault (a prompt over
the server's context) and complete with that error. After `2 * concurrency` failures in a row the
server is taken for dead and the run stops. A reply cut at max_tokens has finish "length".
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from dflash_cache.core.errors import UserError
from dflash_cache.generate.requests import ERROR, LENGTH, STOP, Completion, Request

PROBES = ("Hello, world!", "def add(a, b):\n    return a + b\n", "<|im_start|>user\n1 + 1 = ?<|im_end|>\n")
_RETRYABLE = {408, 409, 425, 429, 500, 502, 503, 504}


class ServerError(UserError, RuntimeError):
    """A server that cannot be used: unreachable, no model, another tokenizer, or dead mid-run."""


class _HttpError(Exception):
    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status


class ServerBackend:
    """`requests.Backend` over an OpenAI-compatible server at `url` (see the module docstring)."""

    def __init__(self, url: str, *, tokenizer, model: str | None = None, temperature: float = 0.0,
                 concurrency: int = 16, retries: int = 5, timeout: float = 600.0,
                 backoff: float = 0.5) -> None:  # fmt: skip
        self.base = url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.temperature, self.concurrency = tokenizer, temperature, concurrency
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        eos = tokenizer.eos_token_id
        self.eos = eos if isinstance(eos, int) else None
        self.model = model or self._served_model()
        self.prompt_ids = self._takes_token_ids()
        self.checks = self._check_tokenizer()

    # ------------------------------------------------------------------ start-up checks

    def _served_model(self) -> str:
        try:
            models = self._call("GET", "/v1/models", timeout=10)
        except _HttpError as e:
            raise ServerError(f"--server {self.base}: cannot reach it ({e})") from None
        data = models.get("data") or []
        if not data:
            raise ServerError(f"--server {self.base}: /v1/models lists no model")
        return data[0]["id"]

    def _takes_token_ids(self) -> bool:
        """Whether /v1/completions takes a prompt of token ids (vLLM, SGLang, llama.cpp's server do;
        llama-cpp-python's takes text only)."""
        for prompt in (self.tokenizer("Hi", add_special_tokens=False)["input_ids"], "Hi"):
            try:
                self._call("POST", "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1},
                           timeout=60)  # fmt: skip
                return not isinstance(prompt, str)
            except _HttpError as e:
                # a validation error of the prompt's type: llama-cpp-python answers 500, others 400 or 422
                if isinstance(prompt, str) or e.status is None or "prompt" not in str(e):
                    raise ServerError(f"--server {self.base}: a one-token completion failed ({e})") from None
        raise AssertionError("unreachable")

    def _check_tokenizer(self) -> str:
        """Compare the server's tokenization of the probes with the target tokenizer's."""
        for path, body in (("/tokenize", lambda t: {"model": self.model, "prompt": t, "content": t,
                                                    "add_special_tokens": False}),
                           ("/extras/tokenize", lambda t: {"model": self.model, "input": t})):  # fmt: skip
            try:
                got = [self._call("POST", path, body(t), timeout=30).get("tokens") for t in PROBES]
            except _HttpError:
                continue
            want = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROBES]
            got = [_strip_bos(g, w, self.tokenizer.bos_token_id) for g, w in zip(got, want, strict=True)]
            if got != want:
                bad = next(t for t, g, w in zip(PROBES, got, want, strict=True) if g != w)
                raise ServerError(f"--server {self.base}: its tokenizer is not the target's ({bad!r} gives "
                                  "other ids); serve the target's tokenizer, or pass the served model as --target")
            return f"tokenizer: {len(PROBES)} probe texts tokenize alike ({path}); weights: not checkable"
        if not self.prompt_ids:
            raise ServerError(f"--server {self.base}: it takes text prompts only and has no tokenize endpoint, so "
                              "nothing shows it tokenizes as the target does")  # fmt: skip
        return "tokenizer and weights: not checkable (no tokenize endpoint); prompts are sent as token ids"

    # ------------------------------------------------------------------ generation

    def stream(self, requests: Iterable[Request | None]) -> Iterator[Completion]:
        """Up to `concurrency` requests in flight; completions as they arrive."""
        source, exhausted = iter(requests), False
        running: set[Future] = set()
        failures = 0
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="server") as pool:
            while True:
                while not exhausted and len(running) < self.concurrency:
                    r = next(source, _END)
                    if r is _END:
                        exhausted = True
                    elif r is not None:
                        running.add(pool.submit(self._complete, r))
                        continue
                    break
                if not running:
                    if exhausted:
                        return
                    raise RuntimeError("the request source is waiting on completions, but none is in flight")
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    c = f.result()
                    failures = failures + 1 if c.retry else 0
                    if failures >= 2 * self.concurrency:
                        for other in running:
                            other.cancel()
                        raise ServerError(f"--server {self.base}: {failures} requests in a row failed ({c.error}); "
                                          "what was committed is kept, rerun to resume")  # fmt: skip
                    yield c

    def _complete(self, r: Request) -> Completion:
        t0 = time.perf_counter()
        prompt = list(r.prompt) if self.prompt_ids else self.tokenizer.decode(list(r.prompt))
        body = {"model": self.model, "prompt": prompt, "max_tokens": r.max_new_tokens,
                "temperature": self.temperature, "seed": r.seed % (1 << 31), "stream": False}  # fmt: skip
        for attempt in range(self.retries + 1):
            try:
                reply = self._call("POST", "/v1/completions", body, timeout=self.timeout)
                break
            except _HttpError as e:
                if e.status is not None and e.status not in _RETRYABLE:
                    return Completion(r, [], ERROR, error=f"the server refused the request ({e})")
                if attempt == self.retries:
                    return Completion(r, [], ERROR, error=f"the server failed {attempt + 1} times ({e})", retry=True)
                time.sleep(self.backoff * 2**attempt)
        choice = reply["choices"][0]
        text = choice.get("text") or ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        stopped = choice.get("finish_reason") != "length"
        if stopped and self.eos is not None:
            ids = [*ids, self.eos]  # the end of turn the server stopped at and left out of its text
        return Completion(r, ids, STOP if stopped else LENGTH, seconds=time.perf_counter() - t0, text=text)

    def _call(self, method: str, path: str, body: dict | None = None, *, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode(errors="replace").strip()
            raise _HttpError(e.code, f"HTTP {e.code} {detail}".strip()) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _HttpError(None, str(getattr(e, "reason", e))) from None
        except json.JSONDecodeError as e:
            raise _HttpError(None, f"not JSON ({e})") from None


_END = object()


def _strip_bos(got: list[int] | None, want: list[int], bos: int | None) -> list[int] | None:
    """A tokenize endpoint may prepend the BOS the completion would add; compare without it."""
    if got and bos is not None and got[0] == bos and (not want or want[0] != bos):
        return got[1:]
    return got
