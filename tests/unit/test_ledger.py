"""Host-wide cap on pinned bytes: one ledger, several real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmcache.host.ledger import Ledger, LedgerEntry

MiB = 1 << 20


def test_reserve_grants_up_to_the_cap_and_counts_other_domains(tmp_path):
    path = str(tmp_path / "ledger.json")
    a = Ledger(path, cap=100 * MiB)
    assert a.reserve("a", 60 * MiB) == 60 * MiB
    assert a.reserve("b", 60 * MiB) == 40 * MiB  # only what a left
    assert a.reserve("a", 10 * MiB) == 10 * MiB  # a's reservation is a total, not an increment
    assert a.reserve("b", 90 * MiB) == 90 * MiB
    assert a.reserve("c", 5 * MiB) == 0
    assert {d: e.bytes for d, e in a.entries().items()} == {"a": 10 * MiB, "b": 90 * MiB, "c": 0}
    a.release("b")
    assert a.reserve("c", 5 * MiB) == 5 * MiB
    on_disk = json.loads(Path(path).read_text())["domains"]
    assert on_disk["a"]["pid"] == os.getpid() and on_disk["a"]["bytes"] == 10 * MiB


def test_no_cap_grants_everything(tmp_path):
    ledger = Ledger(str(tmp_path / "l.json"), cap=None)
    assert ledger.reserve("a", 1 << 50) == 1 << 50


def test_dead_agents_do_not_hold_their_share(tmp_path):
    path = str(tmp_path / "ledger.json")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    Ledger(path, cap=100 * MiB, pid=dead.pid).reserve("gone", 80 * MiB)
    # the dead pid's entry is dropped: the whole cap is free again
    assert Ledger(path, cap=100 * MiB).reserve("live", 100 * MiB) == 100 * MiB
    assert set(Ledger(path, cap=100 * MiB).entries()) == {"live"}


def test_reused_pid_is_not_the_agent_that_reserved(tmp_path):
    path = tmp_path / "ledger.json"
    # our own pid, but with a start time that is not ours: another process now
    path.write_text(json.dumps({"domains": {"old": {"pid": os.getppid(), "pid_start_time": 1, "bytes": 90 * MiB}}}))
    assert Ledger(str(path), cap=100 * MiB).reserve("new", 100 * MiB) == 100 * MiB


def test_damaged_ledger_is_rebuilt(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{not json")
    assert Ledger(str(path), cap=10).reserve("a", 10) == 10
    path.write_text(json.dumps({"domains": {"x": {"pid": "nope"}, "y": 3}}))
    assert Ledger(str(path), cap=10).reserve("a", 10) == 10


def test_negative_want_is_refused(tmp_path):
    with pytest.raises(ValueError):
        Ledger(str(tmp_path / "l.json"), cap=10).reserve("a", -1)


AGENT = r"""
import sys, time
from vmcache.host.ledger import Ledger
path, domain, cap, want, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ledger = Ledger(path, cap)
granted, over = [], 0
for i in range(rounds):
    # ask for a varying amount, as an agent does from cycle to cycle
    granted.append(ledger.reserve(domain, want if i % 2 else want // 2))
    # a consistent snapshot (taken under the lock) never sums over the cap
    over += sum(e.bytes for e in ledger.entries().values()) > cap
print(max(granted), over)
sys.stdout.flush()
sys.stdin.read()          # hold the reservation until told to go
ledger.release(domain)
"""


def test_several_processes_never_exceed_the_cap(tmp_path):
    path = str(tmp_path / "ledger.json")
    cap = 100 * MiB
    procs = [
        subprocess.Popen([sys.executable, "-c", AGENT, path, f"dom{i}", str(cap), str(40 * MiB), "200"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    try:
        results = [p.stdout.readline().split() for p in procs]
        maxima = [int(r[0]) for r in results]
        assert [int(r[1]) for r in results] == [0, 0, 0, 0]  # no snapshot over the cap, ever
        # while all four hold their last grant, the ledger is within the cap
        entries = Ledger(path, cap).entries()
        assert set(entries) == {f"dom{i}" for i in range(4)}
        assert sum(e.bytes for e in entries.values()) <= cap
        assert all(isinstance(e, LedgerEntry) and e.pid in {p.pid for p in procs} for e in entries.values())
        assert max(maxima) == 40 * MiB  # someone got a full grant: the cap is shared, not split blindly
        # a process killed without releasing: its share comes back
        procs[0].kill()
        procs[0].wait()
        time.sleep(0.05)
        held = sum(e.bytes for d, e in Ledger(path, cap).entries().items())
        assert "dom0" not in Ledger(path, cap).entries()
        assert Ledger(path, cap).reserve("late", cap) == cap - held
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)
    assert set(Ledger(path, cap).entries()) == {"late"}  # the others released on exit


# -- dividing the cap by benefit (share.json beside the ledger) ----------------------------

def flat(nbytes, density):
    return ((nbytes, nbytes * density),)


def test_divide_splits_by_benefit_and_records_both_files(tmp_path):
    from vmcache.model.share import Demand

    path = str(tmp_path / "ledger.json")
    a = Ledger(path, cap=100 * MiB)
    # a comes first and wants all of it: alone, it gets the cap
    first = a.divide("a", Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.2)))
    assert first.granted == 100 * MiB
    a.reserve("a", 100 * MiB)  # it pinned that much
    # b is denser: the split gives it its budget, but a still holds the bytes
    b = a.divide("b", Demand(budget=60 * MiB, curve=flat(60 * MiB, 0.9)))
    assert b.split.grants == {"a": 40 * MiB, "b": 60 * MiB}
    assert b.granted == 0
    # a's next cycle: its grant shrinks, it unpins down to it
    after = a.divide("a", Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.2)), held=100 * MiB)
    assert after.granted == 40 * MiB and after.held["a"] == 100 * MiB  # still counts what it holds
    a.reserve("a", 40 * MiB)
    assert a.divide("b", Demand(budget=60 * MiB, curve=flat(60 * MiB, 0.9))).granted == 60 * MiB
    share = json.loads((tmp_path / "share.json").read_text())
    assert share["version"] == 1 and share["cap"] == 100 * MiB
    assert share["domains"]["b"]["granted"] == 60 * MiB and share["domains"]["b"]["demand"] == [[60 * MiB, round(0.9 * 60 * MiB)]]
    ledger = json.loads((tmp_path / "ledger.json").read_text())["domains"]
    assert {d: e["bytes"] for d, e in ledger.items()} == {"a": 40 * MiB, "b": 60 * MiB}
    a.release("b")
    assert "b" not in json.loads((tmp_path / "share.json").read_text())["domains"]


def test_older_agents_entries_are_fixed_and_survive_their_rewrites(tmp_path):
    from vmcache.model.share import Demand

    path = tmp_path / "ledger.json"
    # an older agent (our own pid stands in for a live one) holds 70 MiB, no demand
    path.write_text(json.dumps({"domains": {"old": {"pid": os.getpid(), "pid_start_time": None, "bytes": 70 * MiB}}}))
    new = Ledger(str(path), cap=100 * MiB, pid=os.getppid())
    got = new.divide("new", Demand(budget=100 * MiB, curve=flat(100 * MiB, 1.0)))
    assert got.split.fixed == 70 * MiB and got.granted == 30 * MiB
    # the older agent rewrites ledger.json with the fields it knows: share.json is untouched
    data = json.loads(path.read_text())
    data["domains"] = {d: {k: v for k, v in e.items() if k in ("pid", "pid_start_time", "bytes")}
                       for d, e in data["domains"].items()}
    path.write_text(json.dumps(data))
    assert new.host_share().demands["new"].curve == flat(100 * MiB, 1.0)


def test_a_dead_agents_demand_and_share_return_at_once(tmp_path):
    from vmcache.model.share import Demand

    path = str(tmp_path / "ledger.json")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = Ledger(path, cap=100 * MiB, pid=dead.pid)
    gone.divide("gone", Demand(budget=100 * MiB, curve=flat(100 * MiB, 1.0)))
    live = Ledger(path, cap=100 * MiB).divide("live", Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.1)))
    assert set(live.demands) == {"live"} and live.granted == 100 * MiB


def test_damaged_share_file_is_ignored(tmp_path):
    from vmcache.model.share import Demand

    (tmp_path / "share.json").write_text(json.dumps({"version": 1, "domains": {
        "x": {"pid": os.getpid(), "budget": 5, "demand": [[10, 1.0], [5, 2.0]]},
        "y": {"pid": os.getpid(), "budget": -5}, "z": "no"}}))
    got = Ledger(str(tmp_path / "ledger.json"), cap=MiB).divide("a", Demand(budget=MiB))
    assert set(got.demands) == {"a"} and got.granted == MiB
    (tmp_path / "share.json").write_text("{broken")
    assert Ledger(str(tmp_path / "ledger.json"), cap=MiB).divide("a", Demand(budget=MiB)).granted == MiB


def test_minimums_over_the_cap_are_reported(tmp_path):
    from vmcache.model.share import Demand

    ledger = Ledger(str(tmp_path / "ledger.json"), cap=10 * MiB)
    ledger.divide("a", Demand(budget=10 * MiB, minimum=8 * MiB))
    got = ledger.divide("b", Demand(budget=10 * MiB, minimum=8 * MiB))
    assert got.split.error and sum(got.split.grants.values()) <= 10 * MiB
    assert Ledger(str(tmp_path / "ledger.json"), cap=None).host_share().split.error == got.split.error


def test_forget_removes_a_domain_from_both_files_even_a_dead_agents_and_makes_nothing(tmp_path):
    """For the hook once a domain's agents are gone: a dead agent's entries are not left in the files."""
    path = tmp_path / "run" / "ledger.json"
    assert Ledger(str(path), None).forget("web-1") == []
    assert not (tmp_path / "run").exists()
    Ledger(str(path), None).reserve("db-2", 1 << 20)
    Ledger(str(path), None, pid=2 ** 22 + 5).reserve("web-1", 1 << 20)  # then killed: no other agent writes
    hook = Ledger(str(path), None, alive=lambda pid, start: pid != 2 ** 22 + 5)
    assert set(hook.entries()) == {"db-2"}  # dead to whoever reads: loading drops it from the view...
    assert set(json.loads(path.read_text())["domains"]) == {"db-2", "web-1"}  # ...not from the file
    assert hook.forget("web-1") == [str(path)]
    assert list(json.loads(path.read_text())["domains"]) == ["db-2"]
    assert hook.forget("web-1") == []
