"""The soak bench's leak check: least-squares slopes of its samples."""

from __future__ import annotations

from kvmesh_apps.benchmarks.soak import _slope


def test_slopes_are_least_squares_per_minute():
    assert _slope([(0, 5.0), (1, 7.0), (2, 9.0)]) == 2.0
    flat_with_noise = [(t, 100.0 + (0.5 if t % 2 else -0.5)) for t in range(20)]
    assert abs(_slope(flat_with_noise)) < 0.05
    assert _slope([(3, 1.0)]) == 0.0 and _slope([(1, 1.0), (1, 2.0)]) == 0.0
