"""`edl.feed.Feed` (what `edl.torch.ElasticLoader` runs on): one reader per trainer
feeding forked worker processes. Two such trainers with two workers each read every
record exactly once a pass, with no lease running out at the pass end; a drain hands the
tasks in flight back with nothing lost."""

from __future__ import annotations

import collections

from conftest import wait_until
from test_tasks import housing_rows, lines, reader_env, trainer


def rows_of(batches):
    return [tuple(r + [l]) for b in batches for r, l in zip(b["rows"], b["labels"])]


def test_two_trainers_with_two_feed_workers_each_read_every_record_exactly_once(
        make_job, tmp_path):
    job = make_job("feed", passes=2)
    trainer(job, "first").close()  # stores the spec
    procs = []
    outs = []
    for id in ("feed-a", "feed-b"):
        env = reader_env(job, tmp_path, id, FEED_WORKERS="2")
        procs.append(job.python("programs/feed_reader.py", env=env))
        outs.append(env["READER_OUT"])
    for p in procs:
        wait_until(lambda: not p.alive(), 120, "the feed readers to finish")
        assert p.p.returncode == 0, p.text()
    all_rows = []
    idle = 0
    for out in outs:
        got = lines(out)
        batches = [x for x in got if "task" in x]
        end = [x for x in got if "ends" in x][0]
        ends, idle = end["ends"], idle + end["idle"]
        report = [x for x in got if "report" in x][0]["report"]
        # Several workers of each trainer decoded (the feed really spread the tasks)...
        assert len({b["worker"] for b in batches}) >= 2, {b["worker"] for b in batches}
        # ...every task it trained was acknowledged, and the report counts them.
        assert set(ends.values()) == {"done"}, ends
        assert report["tasks"] == len(ends), (report, len(ends))
        assert report["records"] == len(rows_of(batches)), report
        all_rows += rows_of(batches)
    twice = collections.Counter({row: 2 * n for row, n in housing_rows().items()})
    assert collections.Counter(all_rows) == twice  # two passes
    # Workers waited for tasks while the other held batches (their items taken strictly
    # in turn, as a DataLoader in order does), and no lease ran out meanwhile: an idle
    # worker's turn does not hold up the batches the pass end waits for.
    assert idle > 0
    master = job.procs[0].text()
    assert "pass finished" in master and "timed out" not in master, master[-3000:]


def test_a_drain_hands_the_tasks_in_flight_back(make_job, tmp_path):
    job = make_job("feed-drain")
    trainer(job, "first").close()
    env = reader_env(job, tmp_path, "feed-stopped", FEED_WORKERS="2", STOP_AFTER="5")
    p = job.python("programs/feed_reader.py", env=env)
    wait_until(lambda: not p.alive(), 120, "the drained feed reader to exit")
    assert p.p.returncode == 0, p.text()
    got = lines(env["READER_OUT"])
    batches = [x for x in got if "task" in x]
    ends = [x for x in got if "ends" in x][0]["ends"]
    report = [x for x in got if "report" in x][0]["report"]
    assert report["drained"] is True, report
    assert len(batches) == 5
    handed_back = {k for k, v in ends.items() if v == "handed back"}
    done = {k for k, v in ends.items() if v == "done"}
    # The drain caught tasks in flight (read ahead, or in the middle of one).
    assert handed_back, ends
    assert report["tasks"] == len(done), report
    # Another trainer reads the rest: the handed-back tasks whole, no done task again.
    rest = []
    tasks = []
    t = trainer(job, "finisher")
    for task in t.tasks():
        with task:
            s = task.samples()
            rest += [tuple(list(d) + [l]) for d, l in zip(s["dense"].tolist(),
                                                          s["label"].tolist())]
            tasks.append(f"{task.pass_}/{task.id}")
    t.close()
    assert handed_back <= set(tasks), (handed_back, tasks)
    assert not done & set(tasks)
    kept = rows_of(b for b in batches if b["task"] in done)
    assert collections.Counter(kept + rest) == housing_rows()
