"""The non-Python commands a test needs (backend/binaries.py: redis-server; node and npm for Pi), checked
where the test asks for them.

When one cannot be used (`make venv` could not install it: no PyPI, no wheel for this platform, no root
for the system package), the first test that needs it fails, once per session, naming every unusable
command and the command that installs them; every later test that needs one is skipped with a pointer to
that failure. A missing redis-server thus reads as one failure, not one error per Redis test.
"""

from __future__ import annotations

import os

import pytest

from backend import binaries


class Preflight:
    """Owns one fact: which test, if any, already reported the missing binaries."""

    def __init__(self) -> None:
        self.reported_by: str | None = None

    def need(self, *names: str, test: str | None = None) -> dict[str, str]:
        """The path of each command (the venv's copy first), or fail / skip the current test (its node id:
        `test`, else pytest's PYTEST_CURRENT_TEST, which is set once the test's own setup has begun)."""
        problems = {n: p for n in names if (p := binaries.problem(n))}
        if not problems:
            return {n: str(binaries.which(n)) for n in names}
        if self.reported_by is not None:
            pytest.skip(f"{', '.join(problems)} unusable: reported once, by {self.reported_by}")
        self.reported_by = test or os.environ.get("PYTEST_CURRENT_TEST", "the first test needing it").split(" (")[0]
        unusable = [n for n in binaries.BINARIES if binaries.problem(n)]  # name all of them: one fix for the session
        lines = [f"  - {binaries.problem(n)}" for n in unusable]
        pytest.fail("\n".join([
            f"this test needs {', '.join(problems)}: `make venv` installs these binaries, and could not here:",
            *lines,
            "install them with:",
            "  " + binaries.how_to_install(unusable),
        ]), pytrace=False)


PREFLIGHT = Preflight()
need = PREFLIGHT.need
