"""A headless Chromium driven through the DevTools protocol (aiohttp's websocket client; no Playwright,
no browser download): launch, navigate, evaluate, wait for a condition, screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp


class Browser:
    def __init__(self, executable: str, log: Path) -> None:
        self.executable = executable
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile = tempfile.TemporaryDirectory(prefix="view-chromium-")
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def start(self, width: int = 1280, height: int = 1000) -> None:
        argv = [self.executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
                f"--user-data-dir={self._profile.name}", "--remote-debugging-port=0",
                f"--window-size={width},{height}", "about:blank"]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        port = await self._devtools_port()
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    async def _devtools_port(self, timeout: float = 60) -> int:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", self.log.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            if self._proc is not None and self._proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        raise RuntimeError(f"chromium did not start; its log ({self.log}):\n{self.log.read_text(errors='replace')}")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        if self._ws is None:
            raise RuntimeError("browser not started")
        msg_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await self._ws.receive(timeout=60)).data)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    async def eval(self, expression: str) -> Any:
        out = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def wait(self, condition: str, timeout: float = 30) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                value = await self.eval(condition)
            except RuntimeError:
                value = None  # a navigation in between
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {condition!r}")
            await asyncio.sleep(0.2)

    async def emulate(self, width: int, height: int, mobile: bool = False) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=2 if mobile else 1, mobile=mobile)

    async def screenshot(self, path: Path, width: int | None = None, mobile: bool = False) -> None:
        """The whole page, not just the window (the sessions sit below the engines), `width` CSS pixels wide."""
        if width is not None:
            await self.emulate(width, 800, mobile)
            await asyncio.sleep(0.3)
        width = width or int(await self.eval("document.documentElement.clientWidth") or 1280)
        height = int(await self.eval("Math.ceil(document.documentElement.scrollHeight)") or 1000)
        await self.emulate(width, height, mobile)
        shot = await self.send("Page.captureScreenshot", format="png")
        await self.send("Emulation.clearDeviceMetricsOverride")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._profile.cleanup()
