"""Local bans: growth, cap, expiry and forgetting (pure), and their wiring into
the connection layer and the DHT (real sockets on 127.0.0.1)."""

from __future__ import annotations

import pytest

from swarm import ConfigError, ManualClock
from swarm._bans import BanConfig, BanList


def test_first_offence_bans_for_the_base_period_then_expires() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=50.0), clock=clock)
    assert not bans.is_banned("a")
    assert bans.offend("a", "bad frame") == 10.0
    assert bans.is_banned("a") and not bans.is_banned("b")
    assert bans.reason("a") == "bad frame"
    clock.advance(9.999)
    assert bans.is_banned("a")
    clock.advance(0.001)
    assert not bans.is_banned("a")
    assert bans.reason("a") is None
    assert bans.remaining("a") == 0.0


def test_repeated_offences_double_the_ban_up_to_the_cap() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=1000.0), clock=clock)
    periods = []
    for _ in range(6):
        periods.append(bans.offend("a", "again"))
        clock.advance(bans.remaining("a"))  # serve the ban, then offend again
        assert not bans.is_banned("a")
    assert periods == [10.0, 20.0, 40.0, 80.0, 100.0, 100.0]
    assert bans.offences("a") == 6


def test_good_behaviour_is_forgiven_after_forget_after() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=50.0), clock=clock)
    bans.offend("a", "x")
    bans.offend("a", "x")  # 20 s from now
    clock.advance(20.0 + 49.0)
    assert bans.offences("a") == 2
    assert bans.offend("a", "x") == 40.0  # still remembered
    clock.advance(40.0 + 50.0)
    assert bans.offences("a") == 0
    assert bans.offend("a", "x") == 10.0  # a fresh start


def test_an_offence_during_a_ban_extends_it_from_now() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0), clock=clock)
    bans.offend("a", "x")
    clock.advance(5.0)
    bans.offend("a", "x")
    assert bans.remaining("a") == 20.0


def test_memory_is_bounded() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=10.0, forget_after=0.0, max_entries=100), clock=clock)
    for i in range(1000):
        clock.advance(0.01)
        bans.offend(i, "flood")
    assert len(bans) <= 100
    assert bans.is_banned(999)  # the newest are kept


def test_base_zero_disables_banning() -> None:
    bans = BanList(BanConfig(base=0.0), clock=ManualClock())
    assert bans.offend("a", "x") == 0.0
    assert not bans.is_banned("a")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": -1.0},
        {"base": 10.0, "cap": 5.0},
        {"forget_after": float("inf")},
        {"max_entries": 0},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BanConfig(**kwargs)  # type: ignore[arg-type]
