"""Dataset rows and leased claims: JSONL errors name file and line; tickets are handed out
once, expired leases come back first, and only the lease holder can publish."""

from __future__ import annotations

import threading

import pytest

from producers.dataset import DatasetError, Order, load_rows
from streamer import demo
from streamer.admission import EXHAUSTED, WAIT, Admission, LeaseLost, Leases


def _expire(client, keys, ticket: int) -> None:
    """Move a lease's expiry just into the past by the server's clock (the one the claim
    script reads): a lease that ran out, without racing a short real lease against a busy
    machine (a 0.3 s lease could expire before the next line runs)."""
    secs, micros = client.time()
    changed = client.zadd(keys.leases, {str(ticket): secs + micros / 1e6 - 1}, xx=True, ch=True)
    assert changed == 1, f"ticket {ticket} holds no lease"


# ---------------------------------------------------------------- rows


def test_demo_rows_and_a_jsonl_file(tmp_path):
    assert load_rows("demo") == demo.rows("train") and load_rows("demo", split="eval") == demo.rows("eval")
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    rows = load_rows(str(p), cache_dir=tmp_path / "cache")  # through datasets where it is installed
    assert list(rows) == [
        {"prompt": "2+2=", "answer": "4"},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]


def test_the_demo_split_holds_out_pairs_whose_mirror_and_answer_are_trained():
    pair = lambda row: tuple(int(d) for d in row["messages"][0]["content"].rstrip("=").split("+"))  # noqa: E731
    train, held = [pair(r) for r in demo.rows("train")], [pair(r) for r in demo.rows("eval")]
    assert len(train) == 45 and len(held) == 10 and not set(train) & set(held)
    for a, b in held:
        assert (b, a) in train, f"{a}+{b}: its mirror is not trained"
        assert sum(a2 + b2 == a + b for a2, b2 in train) >= 3, f"{a}+{b}: its answer is rare in training"
    for d in range(10):
        assert any(a == d for a, _ in train) and any(b == d for _, b in train), f"digit {d}"


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"prompt": "x"', "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"answer": "4"}', "needs `messages` (a chat) or `prompt`"),
        ('{"prompt": ""}', "`prompt` must be a non-empty string"),
        ('{"messages": []}', "`messages` must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "messages[0] needs a string `content`"),
    ],
)
def test_a_bad_line_names_file_and_line(tmp_path, line, reason):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n\n' + line + "\n")
    with pytest.raises(DatasetError) as e:
        load_rows(str(p), cache_dir=tmp_path / "cache")
    assert str(e.value).startswith(f"{p}:3: ") and reason in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_rows(str(tmp_path / "nope.jsonl"), cache_dir=tmp_path / "cache")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_rows(str(tmp_path / "empty.jsonl"), cache_dir=tmp_path / "cache")


def test_each_epoch_is_a_seeded_permutation():
    order = Order(10, seed=3)
    epochs = [[order.position(t).row for t in range(e * 10, e * 10 + 10)] for e in range(3)]
    assert all(sorted(rows) == list(range(10)) for rows in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert epochs[0] == [Order(10, seed=3).position(t).row for t in range(10)]  # deterministic
    assert order.position(25).epoch == 2 and order.total_tickets(2) == 20 and order.total_tickets(0) is None


# ---------------------------------------------------------------- leases


def test_tickets_in_order_then_exhausted_once_leases_end(client, keys):
    a = Leases(client, keys, owner="a", lease_seconds=30, total_tickets=3)
    got = [a.claim() for _ in range(3)]
    assert got == [0, 1, 2]
    assert a.claim() == WAIT  # all claimed, but leases are open
    assert a.finish(0) and a.publish(1, b"x") and a.finish(2)
    assert a.claim() == EXHAUSTED
    assert client.zcard(keys.leases) == 0 and client.hlen(keys.lease_owner) == 0


def test_a_publish_gets_the_next_rollout_step_and_the_current_version(client, keys):
    a = Leases(client, keys, owner="a", lease_seconds=30)
    first = a.publish(a.claim(), b"x")
    client.set(keys.version, 7)
    second = a.publish(a.claim(), b"y")
    assert (first.rollout_step, first.version) == (1, None)
    assert (second.rollout_step, second.version) == (2, b"7")
    assert [i for i, _ in client.xrange(keys.traj)] == [first.entry_id.encode(), second.entry_id.encode()]
    b = Leases(client, keys, owner="b", lease_seconds=30)
    assert b.publish(a.claim(), b"z") is None  # not b's lease: no entry, no step
    assert client.get(keys.rollout_step) == b"2" and client.xlen(keys.traj) == 2


def test_concurrent_claims_are_disjoint_and_complete(redis_url, keys):
    from streamer.connection import connect

    got: list[int] = []
    lock = threading.Lock()

    def worker(name):
        c = connect(redis_url)
        leases = Leases(c, keys, owner=name, lease_seconds=30, total_tickets=200)
        while (t := leases.claim()) >= 0:
            leases.finish(t)
            with lock:
                got.append(t)
        c.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(got) == list(range(200))


def test_an_expired_lease_is_handed_out_again_first(client, keys):
    dead = Leases(client, keys, owner="dead", lease_seconds=30)
    alive = Leases(client, keys, owner="alive", lease_seconds=30)
    assert dead.claim() == 0
    assert alive.claim() == 1  # lease of 0 still valid: a new ticket
    _expire(client, keys, 0)
    assert alive.claim() == 0  # requeued before any new ticket
    assert client.hget(keys.lease_owner, "0") == b"alive"
    assert dead.publish(0, b"late") is None and client.xlen(keys.traj) == 0  # the dead one lost it
    assert not dead.renew(0) and alive.renew(0)


def test_hand_back_requeues_at_the_front(client, keys):
    a = Leases(client, keys, owner="a", lease_seconds=30)
    assert [a.claim(), a.claim()] == [0, 1]
    assert a.hand_back(1) and not a.hand_back(1)  # second time: not ours any more
    assert a.claim() == 1 and a.claim() == 2


def test_publish_and_lease_end_are_one_step(client, keys):
    a = Leases(client, keys, owner="a", lease_seconds=30)
    b = Leases(client, keys, owner="b", lease_seconds=30)
    t = a.claim()
    assert b.publish(t, b"not mine") is None and client.xlen(keys.traj) == 0
    entry = a.publish(t, b"payload")
    assert entry and client.xrange(keys.traj)[0][1] == {b"d": b"payload"}
    assert client.zscore(keys.leases, str(t)) is None and a.publish(t, b"again") is None


def test_slots_of_unpublished_leases_are_given_back(client, keys):
    adm = Admission(client, keys, max_staleness=0, groups_per_step=10)
    dead = Leases(client, keys, owner="dead", lease_seconds=30)
    a = Leases(client, keys, owner="a", lease_seconds=30)
    for leases in (dead, a, a):
        t = leases.claim()
        assert adm.try_admit(t, leases.owner)  # the slot is the lease's, in the same script
    assert adm.snapshot()["admitted"] == 3
    a.publish(1, b"g")  # a published group keeps its slot (the trainer releases rejects)
    a.hand_back(2)  # handed back: slot returned
    assert adm.snapshot()["admitted"] == 2
    _expire(client, keys, 0)
    assert a.claim() == 2 and a.claim() == 0  # the handed-back one first, then the expired one
    assert adm.snapshot()["admitted"] == 1 and client.scard(keys.lease_slots) == 0
    # a lease lost while waiting for admission takes no slot
    with pytest.raises(LeaseLost):
        adm.try_admit(0, dead.owner)
    assert adm.snapshot()["admitted"] == 1
