"""Rows that teach nothing step aside: a row whose last groups were all solved (or taught
nothing for longer) is passed over by claims, revisited only within a share of the rows
handed out, and active again after one useful group; when every row is set aside the
producers stop and the run says so; a row record that is missing or unreadable makes the row
new, with one warning."""

from __future__ import annotations

import logging
import threading

import pytest

from producers.components import Task, build
from producers.dataset import Order
from producers.producer import Producer
from schemas import MetricsEvent, TrajectoryGroup, decode
from streamer.admission import AGAIN, NOTHING_TO_TEACH, Admission, Leases
from streamer.cli import up
from streamer.cli.progress import Progress
from streamer.cli.status import render
from streamer.config import RunConfig, parse_config, replace
from streamer.errors import ConfigError
from streamer.readmodel import snapshot
from streamer.rows import Rule

ROWS = 4
ORDER = Order(ROWS, seed=0, shuffle=False)  # ticket t is row t % 4


def _leases(
    client, keys, *, defer_after=2, failed_after=0, share=0.0, pass_rate=0.0
) -> tuple[Leases, Admission]:
    leases = Leases(
        client,
        keys,
        owner="p",
        lease_seconds=60,
        rule=Rule(defer_after, failed_after, share, pass_rate),
        n_rows=ROWS,
    )
    return leases, Admission(client, keys, max_staleness=1000, groups_per_step=1000)


def _group(leases, admission, outcome_of, order=ORDER, rate_of=lambda row: 1.0) -> tuple[int, int]:
    """Claim a row and publish a group with ``outcome_of(row)`` and pass rate ``rate_of(row)``;
    (row, tickets passed over)."""
    cursor = int(leases.client.get(leases.keys.cursor) or 0)
    claim = leases.claim_admit(admission, window=(cursor, order.window(cursor, 64)))
    assert claim.ticket >= 0 and claim.granted, claim
    row = order.position(claim.ticket).row
    assert leases.publish(claim.ticket, b"g", row=(row, outcome_of(row), rate_of(row))) is not None
    return row, claim.passed_over


def _solved_1_failed_2(row: int) -> str:
    return {1: "solved", 2: "failed"}.get(row, "useful")


def test_rows_whose_last_groups_were_all_solved_or_all_failed_are_passed_over(client, keys):
    leases, admission = _leases(client, keys, defer_after=2, failed_after=2)
    first = [_group(leases, admission, _solved_1_failed_2)[0] for _ in range(2 * ROWS)]
    assert first == [0, 1, 2, 3] * 2
    later = [_group(leases, admission, _solved_1_failed_2) for _ in range(6)]
    assert [row for row, _ in later] == [0, 3] * 3, "rows 1 and 2 step aside"
    assert sum(passed for _, passed in later) == 6
    assert client.smembers(keys.rows_solved) == {b"1"} and client.smembers(keys.rows_unsolvable) == {b"2"}
    assert client.hget(keys.rows, 1).startswith(b"2,2,") and client.hget(keys.rows, 0).startswith(b"0,0,")


def test_a_row_that_teaches_nothing_steps_aside_after_more_groups_as_what_it_mostly_was(client, keys):
    seen = dict.fromkeys(range(ROWS), 0)
    pattern = {0: "fff", 1: "sfs", 2: "fsf", 3: "sss"}  # row 1 slips now and then; row 2 rarely passes

    def outcome(row: int) -> str:
        seen[row] += 1
        return {"s": "solved", "f": "failed"}[pattern[row][(seen[row] - 1) % 3]]

    leases, admission = _leases(client, keys, defer_after=4, failed_after=3)
    assert [_group(leases, admission, outcome)[0] for _ in range(3 * ROWS)] == [0, 1, 2, 3] * 3
    assert client.smembers(keys.rows_unsolvable) == {b"0", b"2"}
    assert client.smembers(keys.rows_solved) == {b"1"}, "row 3 needs a fourth solved group"
    assert _group(leases, admission, outcome) == (3, 3)
    assert client.smembers(keys.rows_solved) == {b"1", b"3"}
    assert _group(leases, admission, outcome) == (0, 0), "every row set aside: the last look starts"


@pytest.mark.parametrize("pass_rate", [0.9, 0.0])
def test_a_row_nearly_always_right_steps_aside_at_its_next_solved_group(client, keys, pass_rate):
    visits = dict.fromkeys(range(ROWS), 0)
    rates = {1: (0.9375, 1.0), 2: (0.5, 1.0)}  # row 1: 15 of 16 right, then 16; row 2: 8, then 16

    def outcome(row: int) -> str:
        visits[row] += 1
        return "solved" if row in rates and visits[row] == 2 else "useful"

    rate = lambda row: rates[row][visits[row] - 1] if row in rates else 0.5  # noqa: E731
    leases, admission = _leases(client, keys, defer_after=3, pass_rate=pass_rate)
    assert [_group(leases, admission, outcome, rate_of=rate)[0] for _ in range(2 * ROWS)] == [0, 1, 2, 3] * 2
    assert client.hget(keys.rows, 1) == b"1,1,0.969" and client.hget(keys.rows, 2) == b"1,1,0.750"
    visits.update({1: 0, 2: 0})  # a third round: row 1 useful again, were it handed out
    third = [_group(leases, admission, outcome, rate_of=rate) for _ in range(ROWS - 1)]
    if pass_rate:  # one solved group at a recent pass rate of 0.97: set aside; row 2 (0.75) is not
        assert third == [(0, 0), (2, 1), (3, 0)] and client.smembers(keys.rows_solved) == {b"1"}
    else:  # by the last groups alone, one solved group of three is not enough
        assert third == [(0, 0), (1, 0), (2, 0)] and not client.exists(keys.rows_solved)


def test_a_row_is_judged_by_its_record_as_stored(client, keys):
    leases, admission = _leases(client, keys, defer_after=3, pass_rate=0.95)
    rates = iter([0.9, 0.5, 0.5, 0.5, 0.9998])  # row 0: (0.9 + 0.9998) / 2 = 0.9499, stored 0.950
    for _ in range(ROWS + 1):
        _group(
            leases,
            admission,
            lambda r: "solved" if r == 0 and client.hexists(keys.rows, 3) else "useful",
            rate_of=lambda r: next(rates),
        )
    assert client.hget(keys.rows, 0) == b"1,1,0.950"
    assert client.smembers(keys.rows_solved) == {b"0"}, "set aside as every claim will judge it"


def test_a_row_passed_over_but_missing_from_its_set_is_counted_and_the_last_look_begins(client, keys):
    leases, admission = _leases(client, keys, defer_after=1)
    for _ in range(ROWS):
        _group(leases, admission, lambda r: "solved")
    client.srem(keys.rows_solved, 3)  # its record says solved: claims pass it over

    def claim():
        cursor = int(client.get(keys.cursor))
        return leases.claim_admit(admission, window=(cursor, ORDER.window(cursor, 16)))

    first = claim()
    assert (first.ticket, first.passed_over) == (AGAIN, 16), "every row of the window passed over"
    assert client.scard(keys.rows_solved) == ROWS, "row 3 counted again as it was passed over"
    look = claim()
    assert (look.ticket, look.passed_over) == (ROWS + 16, 0), "every row set aside: the last look begins"


@pytest.mark.parametrize("aside", [1, 3])
def test_revisits_are_a_share_of_the_rows_handed_out_however_many_rows_are_set_aside(client, keys, aside):
    leases, admission = _leases(client, keys, defer_after=1, share=0.25)
    solved, shuffled = set(range(1, aside + 1)), Order(ROWS, seed=0)  # each epoch its own order
    outcome = lambda r: "solved" if r in solved else "useful"  # noqa: E731
    rows = [_group(leases, admission, outcome, shuffled)[0] for _ in range(ROWS + 400)][ROWS:]
    revisits = sum(r in solved for r in rows)
    assert 0.15 * len(rows) <= revisits <= 0.25 * len(rows) + 1, f"{revisits} revisits in {len(rows)} groups"
    assert all(n >= 1 for n in map(rows.count, solved)), "every row set aside is revisited"
    while _group(leases, admission, lambda r: "useful", shuffled)[0] not in solved:  # a revisit teaches
        pass
    assert client.scard(keys.rows_solved) == aside - 1


def test_when_every_row_is_solved_a_last_look_at_each_comes_before_nothing_is_left_to_teach(client, keys):
    leases, admission = _leases(client, keys, defer_after=1, share=0.1)
    for _ in range(ROWS):
        _group(leases, admission, lambda r: "solved")
    looked = [_group(leases, admission, lambda r: "solved") for _ in range(ROWS)]
    assert looked == [(r, 0) for r in range(ROWS)], "one more group of every row, none passed over"
    assert leases.claim_admit(admission, window=(8, ORDER.window(8, 8))).ticket == NOTHING_TO_TEACH
    assert client.zcard(keys.leases) == 0 and int(client.get(keys.admitted)) == 2 * ROWS, "no lease, no slot"


def test_unsolvable_rows_end_a_run_once_revisits_and_a_last_look_taught_nothing(client, keys):
    solved_or_failed = lambda r: "solved" if r % 2 else "failed"  # noqa: E731
    leases, admission = _leases(client, keys, defer_after=1, failed_after=1, share=0.5)
    groups = [_group(leases, admission, solved_or_failed) for _ in range(ROWS)]
    assert client.scard(keys.rows_solved) == client.scard(keys.rows_unsolvable) == 2
    for _ in range(50):  # the revisits earned by the first groups, then the last look
        cursor = int(client.get(keys.cursor))
        claim = leases.claim_admit(admission, window=(cursor, ORDER.window(cursor, 8)))
        if claim.ticket == NOTHING_TO_TEACH:
            break
        assert leases.publish(
            claim.ticket, b"g", row=(claim.ticket % ROWS, solved_or_failed(claim.ticket % ROWS), 1.0)
        )
        groups.append(claim.ticket)
    else:
        pytest.fail(f"nothing left to teach was not said after {len(groups)} groups")
    assert ROWS + ROWS <= len(groups) <= ROWS + ROWS + 2, (
        "1 + 1 revisits banked at most, then one look at each"
    )


def test_a_last_look_that_teaches_puts_the_row_back(client, keys):
    leases, admission = _leases(client, keys, defer_after=1)
    for _ in range(ROWS):
        _group(leases, admission, lambda r: "solved")
    assert _group(leases, admission, lambda r: "useful") == (0, 0)  # the last look: row 0 teaches
    assert client.scard(keys.rows_solved) == ROWS - 1
    assert _group(leases, admission, lambda r: "solved") == (0, ROWS - 1), "the others are passed over again"
    assert not client.exists(keys.last_look)


# ---------------------------------------------------------------- the producer


def _producer(keys, redis_url, tmp_path, client, *, rows: int, reward: float, **producer) -> Producer:
    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 4, "max_new_tokens": 3, "torch_threads": 1, **producer},
        trainer={"groups_per_step": 1000},
    )
    task, sampler = build(cfg)
    task = Task(rows=task.rows[:rows], renderer=task.renderer, reward_fn=lambda *a: reward, reward_path="t")
    return Producer(cfg, client=client, producer_id="p1", task=task, sampler=sampler)


def test_a_producer_stops_when_nothing_is_left_to_teach_and_the_run_says_so(
    client, keys, redis_url, tmp_path, caplog
):
    p = _producer(
        keys,
        redis_url,
        tmp_path,
        client,
        rows=2,
        reward=1.0,
        defer_after=2,
        defer_pass_rate=0,
        revisit_share=0.0,
    )
    with caplog.at_level(logging.INFO, logger="producers.producer"):
        assert p.run() == 0
    assert client.xlen(keys.traj) == 6, "two groups of each row, a last look at each, then nothing"
    said = [r.getMessage() for r in caplog.records if "nothing left to teach" in r.getMessage()]
    assert len(said) == 1 and "every row is set aside (2 solved, 0 unsolvable of 2)" in said[0]
    events = [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]
    assert events[-1].values["nothing_to_teach"] == 1.0 and events[-1].values["rows_active"] == 0
    snap = snapshot(client, keys)
    assert snap.nothing_to_teach and not snap.stalled and (snap.rows_total, snap.rows_solved) == (2, 2)
    text = render(snap)
    assert "0 active, 2 solved, 0 unsolvable" in text and "nothing left to teach" in text
    p.close()


def test_up_ends_its_run_when_a_producer_finds_nothing_left_to_teach(
    client, keys, redis_url, tmp_path, capsys
):
    p = _producer(keys, redis_url, tmp_path, client, rows=1, reward=1.0, defer_after=1)
    assert p.run() == 0
    p.close()
    progress = Progress(p.cfg, target_steps=10, live=False)
    done: list[int] = []
    supervise = threading.Thread(
        target=lambda: done.append(up._supervise(up.Stack(), progress, threading.Event(), until_eval=None)),
        daemon=True,
    )
    supervise.start()
    supervise.join(timeout=30)
    assert done == [0], "up's supervision did not end"
    assert "nothing left to teach; stopping" in capsys.readouterr().out


def test_an_unreadable_or_missing_row_record_makes_the_row_new_with_one_warning(
    client, keys, redis_url, tmp_path, caplog
):
    p = _producer(keys, redis_url, tmp_path, client, rows=2, reward=1.0, defer_after=1)
    client.hset(keys.rows, 0, "not a record")
    client.sadd(keys.rows_solved, 0, 1)  # row 1 has no record at all: every row "set aside"
    with caplog.at_level(logging.WARNING, logger="producers.producer"):
        assert [p.step() for _ in range(2)] == ["published", "published"]
    warned = sorted(r.getMessage().split(":")[0] for r in caplog.records if "record" in r.getMessage())
    assert warned == ["row 0", "row 1"], "one warning per row"
    assert {r.row for r in _groups(client, keys)} == {0, 1}, "both rows handed out as new"
    assert all(client.hget(keys.rows, r).startswith(b"1,1,") for r in (0, 1))
    p.close()


def _groups(client, keys) -> list[TrajectoryGroup]:
    return [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]


@pytest.mark.parametrize(
    "key, value", [("revisit_share", "1.0"), ("revisit_share", "-0.1"), ("defer_pass_rate", "1.5")]
)
def test_a_share_or_rate_outside_0_to_1_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        parse_config(f"[producer]\n{key} = {value}\n")
    assert f"producer.{key}" in str(e.value)
    off = parse_config("[producer]\ndefer_after = 0\ndefer_failed_after = 0\ndefer_pass_rate = 0\n").producer
    rule = Rule(off.defer_after, off.defer_failed_after, off.revisit_share, off.defer_pass_rate)
    assert not rule.on, "0, 0 and 0: rows never step aside"
