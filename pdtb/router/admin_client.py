"""What a supervisor asks a running router: a replacement node added, the node it replaces
retired (`POST /admin/nodes`, pdtb/router/admin.py). Blocking (urllib): supervisors call it from
a thread."""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Callable

RETIRE_WAIT_S = 60.0  # how long a replacement waits for the router to judge the node it replaces lost


def post(url: str, path: str, body: dict, api_key: str | None = None, timeout: float = 10.0) -> None:
    req = urllib.request.Request(f"{url}{path}", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(req, timeout=timeout):
        pass


def add_replacement(url: str | Callable[[], str], role: str, address: str, replaces: str | None,
                    api_key: str | None = None, wait_s: float = RETIRE_WAIT_S) -> None:
    """Add the node at `address`, retiring `replaces` (so /health stops waiting for it) once
    the router has judged that one lost. A router that does not list `replaces` (restarted
    since) only adds it; one that lists `address` already (a restarted router given it) is
    done; one that does not answer (restarting) is asked again. `url` may be a function, read
    at each try (a restarted router's private admin address is a new one). RuntimeError after
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            body = {"role": role, "address": address, **({"replaces": replaces} if replaces else {})}
            post(url() if callable(url) else url, "/admin/nodes", body, api_key)
            return
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if e.code == 409 and "listed already" in text:
                return
            if e.code != 409 or "retire" not in text:
                raise RuntimeError(f"the router answered {e.code} to /admin/nodes: {text[:300]}") from None
            if "no node" in text:
                replaces = None  # (added without it, at once)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router still lists {replaces} as answering: {text[:300]}") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, no admin file: restarting
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not answer /admin/nodes: {e!r}") from None
        time.sleep(0.5)  # (the router judges a silent node lost after its health timeout)
