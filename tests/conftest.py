"""Shared test fixtures. `measured` records the figures a test compares (max differences and
tolerances) and prints them as one table at the end of the run, for closing notes and CI logs."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

_FIGURES: list[tuple[str, str, float, float]] = []


class Measured:
    def __call__(self, name: str, what: str, value: float, tolerance: float) -> float:
        _FIGURES.append((name, what, float(value), float(tolerance)))
        return float(value)


@pytest.fixture
def measured(request):
    recorder = Measured()

    def record(what: str, value: float, tolerance: float = float("nan")) -> float:
        return recorder(request.node.name, what, value, tolerance)

    return record


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("measured differences against the references")
    width = max(len(name) for name, *_ in _FIGURES)
    for name, what, value, tolerance in _FIGURES:
        terminalreporter.write_line(f"{name:<{width}}  {what:<40} {value:10.3e}" + (f"  (tolerance {tolerance:.1e})" if tolerance == tolerance else ""))
