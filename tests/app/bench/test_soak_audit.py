"""The soak script's audit catches what it claims to (no server: a fake runs reader)."""

from __future__ import annotations

from server_process import soak


class FakeReader:
    def __init__(self, rows: dict[str, list[dict]]):
        self.rows = rows

    def by_marker(self, markers):
        return {m: self.rows.get(m, []) for m in markers}


def row(run_id, status="finished", reason="length", text="abc"):
    return {"id": run_id, "status": status, "finish_reason": reason, "output_text": text}


def run_audit(outcomes, rows):
    tally = soak.Tally(outcomes=outcomes)
    failures: list[str] = []
    counts = soak.audit(tally, FakeReader(rows), failures, settle=0)
    return counts, failures


def test_a_clean_run_passes():
    counts, failures = run_audit(
        [soak.Outcome("stream", "[m1]", "r1", 200, "abc", "length"),
         soak.Outcome("disconnect", "[m2]", "r2", 200, "ab", None),
         soak.Outcome("abandon", "[m3]", gave_up=True)],
        {"[m1]": [row("r1")], "[m2]": [row("r2", reason="cancelled", text="ab")],
         "[m3]": [row("r3", reason="cancelled", text="")]})
    assert failures == []
    assert counts["completed"] == 1 and counts["cancelled"] == 2


def test_each_kind_of_problem_is_reported():
    _, failures = run_audit(
        [soak.Outcome("stream", "[text]", "r1", 200, "abc", "length"),
         soak.Outcome("disconnect", "[drop]", "r2", 200, "ab", None),
         soak.Outcome("plain", "[lost]", "r3", 200, "x", "stop"),
         soak.Outcome("stream", "[open]", "r4", 200, "x", "stop"),
         soak.Outcome("stream", "[err]", "r5", 200, "x", None, error="engine failed")],
        {"[text]": [row("r1", text="abX")], "[drop]": [row("r2", text="ab")],
         "[open]": [row("r4", status="running", reason=None)], "[err]": [row("r5")]})
    joined = "\n".join(failures)
    assert "[text] stream: recorded output differs" in joined
    assert "[drop] disconnect: recorded 'length', not 'cancelled'" in joined
    assert "[lost] plain: 0 recorded runs" in joined
    assert "[open] stream: still 'running'" in joined
    assert "[err] stream: status 200: engine failed" in joined
    assert len(failures) == 5
