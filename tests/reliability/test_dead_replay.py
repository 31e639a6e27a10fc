"""`streamer dead --replay`: a dead letter named by its full id is re-published once, however
often the command runs; a partial id (XRANGE reads "1234" as a whole millisecond) is refused."""

from __future__ import annotations

import random

from harness import report
from trainer_data import make_group

from schemas import DeadLetter, encode
from streamer import cli
from streamer.bus import FIELD, entry


def _args(keys, redis_url, tmp_path, *extra: str) -> list[str]:
    return ["dead", "--run", keys.run, "--data-dir", str(tmp_path), "--redis-url", redis_url, *extra]


def test_a_dead_letter_is_replayed_once_and_only_by_its_full_id(client, keys, redis_url, tmp_path, capsys):
    raws = [encode(make_group(random.Random(i))) for i in range(2)]
    letters = [
        DeadLetter(
            stream=keys.traj, entry_id=f"{i + 1}-0", raw=raw, reason="a reward bug", consumer="trainer/t"
        )
        for i, raw in enumerate(raws)
    ]
    # two dead letters in one millisecond: "<ms>" alone names both
    ids = [client.xadd(keys.dead, entry(d), id=f"1700000000000-{i}").decode() for i, d in enumerate(letters)]

    assert cli.main(_args(keys, redis_url, tmp_path, "--replay", "1700000000000")) == 2
    err = capsys.readouterr().err
    assert "full dead-letter id" in err and "1700000000000-0" in err, err
    assert client.xlen(keys.traj) == 0

    for _ in range(3):  # the operator runs it again (a lost reply, an impatient retry)
        assert cli.main(_args(keys, redis_url, tmp_path, "--replay", ids[1])) == 0
    out = capsys.readouterr().out
    assert [f[FIELD] for _, f in client.xrange(keys.traj)] == [raws[1]]  # once, the one named
    assert out.count("re-published dead letter") == 1 and out.count("not again") == 2, out
    report("dead-replay", replays=3, published=client.xlen(keys.traj))
