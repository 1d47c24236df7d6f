"""StallMeter: data-wait fraction high for a slow loader, low for a slow step; bookkeeping."""

from __future__ import annotations

import re
import time

import pytest

from streamds.train.stall import StallMeter


def slow_loader(batches: int, seconds: float):
    """A loader whose next() takes `seconds`: the time StallMeter must attribute to waiting."""
    for i in range(batches):
        time.sleep(seconds)
        yield i


def test_slow_loader_gives_a_high_wait_fraction():
    meter = StallMeter(slow_loader(8, 0.03), window=4)
    for _ in meter:
        pass  # the step does nothing
    summary = meter.summary()
    assert summary["batches"] == 8
    assert summary["wait_fraction"] > 0.8
    assert summary["recent_wait_fraction"] > 0.8
    assert summary["mean_wait_ms"] >= 25


def test_slow_step_gives_a_low_wait_fraction():
    meter = StallMeter(range(8), window=4)
    for _ in meter:
        time.sleep(0.03)  # the training step is the bottleneck
    summary = meter.summary()
    assert summary["wait_fraction"] < 0.2
    assert summary["recent_wait_fraction"] < 0.2
    assert summary["step_s"] >= 8 * 0.025


def test_recent_window_follows_a_change():
    def loader():
        for i in range(12):
            if i >= 6:
                time.sleep(0.02)  # the pipeline slows down half way
            yield i

    meter = StallMeter(loader(), window=4)
    for i in meter:
        if i < 6:
            time.sleep(0.02)
    assert meter.recent_wait_fraction > 0.8
    assert meter.wait_fraction < meter.recent_wait_fraction


def test_first_batch_is_start_up_not_steady_waiting():
    def loader():
        time.sleep(0.05)  # workers starting, buffer filling
        yield from range(5)

    meter = StallMeter(loader())
    for _ in meter:
        time.sleep(0.01)
    assert meter.first_batch_s >= 0.045
    assert meter.wait_fraction < 0.2  # the start-up is reported apart
    assert re.search(r"first batch 0\.\d\d s", str(meter))


def test_injected_clock_gives_exact_numbers():
    now = [0.0]

    class Loader:
        def __iter__(self):
            for i in range(3):
                now[0] += 2.0 if i else 5.0  # first batch after 5 s, then 2 s each
                yield i

    meter = StallMeter(Loader(), clock=lambda: now[0])
    for _ in meter:
        now[0] += 1.0  # each step takes 1 s
    s = meter.summary()
    assert s["first_batch_s"] == 5.0
    assert s["wait_s"] == 4.0
    assert s["step_s"] == 3.0
    assert s["wait_fraction"] == pytest.approx(4 / 7)
    assert s["recent_wait_fraction"] == pytest.approx(4 / 6)  # the last step has no successor
    assert str(meter).startswith("data wait 57.1% (last 2: 66.7%) over 3 batches; first batch")


def test_passes_are_cumulative_and_reset_clears():
    meter = StallMeter([1, 2, 3])
    assert list(meter) == [1, 2, 3]
    assert list(meter) == [1, 2, 3]
    assert meter.batches == 6 and len(meter.startup_s) == 2
    assert len(meter) == 3
    meter.reset()
    assert meter.summary()["batches"] == 0 and meter.first_batch_s is None
    assert meter.wait_fraction == 0.0
    assert "over 0 batches; first batch -" in str(meter)


def test_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        StallMeter([], window=0)
    with pytest.raises(ValueError, match="iterable"):
        StallMeter(5)
