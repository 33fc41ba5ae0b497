"""`python -m proxy --config FILE`: the command `hyperharness serve` runs, with the runtime config it wrote
(proxy/settings.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from proxy.app import create_app
from proxy.format import FormatError
from proxy.server import server_config
from proxy.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy", description="HyperHarness proxy")
    parser.add_argument("--config", type=Path, required=True, help="the runtime config `hyperharness serve` writes")
    args = parser.parse_args(argv)
    try:
        settings = Settings.load(args.config)
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


if __name__ == "__main__":
    sys.exit(main())
