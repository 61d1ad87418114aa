"""GPU test groups (scripts/gpu_test_groups.py) may be cut at their time
limit before pytest prints its summary, which is where a failure's reason
would appear: print each failure's reason as it happens instead."""

import pytest

FAILURE_TAIL_CHARS = 6000


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        reason = report.longreprtext[-FAILURE_TAIL_CHARS:]
        print(f"\n{report.nodeid} failed in {report.when}:\n{reason}", flush=True)
