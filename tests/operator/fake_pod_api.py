"""A server pod's adapter routes, as `pagedllm serve` answers them, on a local port (a thread)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakePodApi:
    """``/v1/models``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; a path in ``refuse`` fails to load
    with the server's error shape, and ``api_key`` (if set) is asked for as the server does."""

    def __init__(self, api_key: str | None = None) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []
        self.refuse: dict[str, str] = {}
        self.api_key = api_key
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                if not fake.authorized(self):
                    return
                cards = [{"id": "base", "object": "model", "parent": None, "root": "/models/base"}]
                cards += [{"id": n, "object": "model", "parent": "base", "root": p} for n, p in fake.loaded.items()]
                self.answer(200, {"object": "list", "data": cards})

            def do_POST(self) -> None:
                if not fake.authorized(self):
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, body))
                name = body["lora_name"]
                if self.path == "/v1/load_lora_adapter":
                    if body["lora_path"] in fake.refuse:
                        return self.error(400, fake.refuse[body["lora_path"]])
                    fake.loaded[name] = body["lora_path"]
                    return self.answer(200, f"Success: LoRA adapter '{name}' added successfully.")
                if fake.loaded.pop(name, None) is None:
                    return self.error(404, f"The lora adapter `{name}` cannot be found")
                self.answer(200, f"Success: LoRA adapter '{name}' removed successfully.")

            def error(self, code: int, message: str) -> None:
                self.answer(code, {"error": {"message": message, "type": "BadRequestError", "code": code}})

            def answer(self, code: int, body) -> None:
                data = (json.dumps(body) if isinstance(body, dict) else body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def authorized(self, handler: BaseHTTPRequestHandler) -> bool:
        if self.api_key is None or handler.headers.get("Authorization") == f"Bearer {self.api_key}":
            return True
        handler.error(401, "invalid or missing API key")  # type: ignore[attr-defined]
        return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
