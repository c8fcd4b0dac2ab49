"""The page's first script: assets/quiet_frames.js, which slows Gradio's idle animation-frame loop to once a second.

It must run before Gradio's scripts, which keep their own reference to requestAnimationFrame; Gradio's `head=` and
`js=` run after them. So an ASGI middleware puts it at the top of the main page's <head> as the page is served.
"""

from __future__ import annotations

from pathlib import Path

from starlette.middleware import Middleware

ASSETS = Path(__file__).resolve().parent.parent / "assets"


class FirstScript:
    """ASGI middleware: `script` as the first element of the main page's <head>."""

    def __init__(self, app, script: str):
        self.app, self.tag = app, f"<script>{script}</script>".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != "/":
            return await self.app(scope, receive, send)
        start, body = None, []

        async def insert(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message  # sent with the body: its length changes
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            page = b"".join(body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            if any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in headers):
                page = page.replace(b"<head>", b"<head>" + self.tag, 1)
            await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, insert)


def quiet_frames() -> Middleware:
    """The middleware for gradio's launch(app_kwargs={"middleware": [...]})."""
    return Middleware(FirstScript, script=(ASSETS / "quiet_frames.js").read_text())
