"""A small REST client for the cluster platforms that speak HTTP (OpenPAI, DLTS).

Their APIs are plain JSON/YAML over HTTP with no SDK worth depending on, so this is
``urllib`` with what a long-running coordinator needs: a timeout on every call, retries
with backoff when the server is briefly away (connection errors, 502/503/504), and error
messages that never carry a credential. URLs are shown without their query string (DLTS
passes the password there) and every known secret is blanked from response bodies
before they reach a message, because those messages end up in logs and in the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})


class RestError(Exception):
    """A call that failed; ``status`` is the HTTP status, 0 when no answer came."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Response:
    """An answer with a 2xx status."""

    status: int
    body: bytes

    def json(self) -> Any:
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise RestError(self.status, f"the server answered with invalid JSON: {e}") from None


class RestClient:
    """Blocking calls (``request``) and their asyncio form (``call``) against one base URL."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 query: Mapping[str, str] | None = None, secrets: Collection[str] = (),
                 timeout: float = 30.0, retries: int = 3, backoff: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        # Sent with every call (DLTS authenticates by query); never shown.
        self._query = dict(query or {})
        self._secrets = tuple(s for s in secrets if s)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def redact(self, text: str) -> str:
        """``text`` with every secret this client knows replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def call(self, method: str, path: str, **kwargs: Any) -> Response:
        """:meth:`request` in a thread, so that the event loop never waits on the network."""
        return await asyncio.to_thread(self.request, method, path, **kwargs)

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                json_body: Any = None, data: bytes | None = None, content_type: str | None = None,
                retry: bool = True) -> Response:
        """One call; retried (when ``retry``) on connection errors and 502/503/504.

        Raises RestError for any other failure, with the status and the server's message.
        A POST that creates something should pass ``retry=False`` unless the server refuses
        duplicates, since a lost answer does not mean the request was lost."""
        params = {**self._query, **(query or {})}
        url = f"{self.base_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        shown = f"{method} {self.base_url}{path}"
        headers = dict(self._headers)
        if json_body is not None:
            data = json.dumps(json_body).encode()
            content_type = content_type or "application/json"
        if content_type:
            headers["Content-Type"] = content_type
        headers.setdefault("Accept", "application/json")
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                return self._once(method, url, data, headers)
            except urllib.error.HTTPError as e:
                body = _read(e)
                if e.code in RETRY_STATUSES and not last:
                    self._pause(attempt, shown, f"HTTP {e.code}")
                    continue
                raise RestError(e.code, f"{shown}: HTTP {e.code}: {self.redact(_message(body, e.reason))}") from None
            except (TimeoutError, urllib.error.URLError, OSError) as e:
                why = self.redact(str(getattr(e, "reason", e)) or type(e).__name__)
                if not last:
                    self._pause(attempt, shown, why)
                    continue
                raise RestError(0, f"{shown}: no answer ({why})") from None
        raise AssertionError("unreachable")

    def _once(self, method: str, url: str, data: bytes | None, headers: dict[str, str]) -> Response:
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout) as answer:
            return Response(answer.status, answer.read())

    def _pause(self, attempt: int, shown: str, why: str) -> None:
        delay = self.backoff * (2**attempt)
        log.debug("%s: %s; trying again in %.1f s", shown, why, delay)
        time.sleep(delay)


def _read(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read()
    except OSError:
        return b""


def _message(body: bytes, reason: object) -> str:
    """The server's own words: a JSON ``message`` field, else the text, else the reason."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        parts = [str(data[k]) for k in ("code", "message", "error") if data.get(k)]
        if parts:
            return ": ".join(parts)
    return text[:500] if text else str(reason)
