"""`python -m proxy --host H --port P --upstream URL --model-dir DIR --model-name NAME [--api-key-file F]
[--redis-url URL]`: the command `hyperharness serve` runs."""

from __future__ import annotations

import logging
import sys

import uvicorn

from proxy.app import create_app
from proxy.format import FormatError
from proxy.settings import Settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_argv(argv)
        settings.check_exposure()
    except ValueError as exc:
        print(f"proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except FormatError as exc:
        print(f"proxy: cannot load the chat format from {settings.model_dir}: {exc}", file=sys.stderr)
        return 2
    # One worker: transcripts of the embedded store live in this process (Redis lifts that limit).
    uvicorn.Server(server_config(app, settings)).run()
    return 0


def server_config(app: object, settings: Settings) -> uvicorn.Config:
    """The HTTP server's settings; a client's idle connection is kept `keep_alive_s` (Settings)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
    )


if __name__ == "__main__":
    sys.exit(main())
