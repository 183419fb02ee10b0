"""``rank_path`` and ``merge_timelines``: per-rank timeline files merged onto one clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_trainer.comm.ops.timeline import Timeline, merge_timelines, rank_path


def test_rank_path() -> None:
    assert rank_path("/t/timeline.json", 0) == "/t/timeline.json"
    assert rank_path("/t/timeline.json", 3) == "/t/timeline.rank3.json"
    assert rank_path("/t/trace", 1) == "/t/trace.rank1"


def _fake(path: Path, rank: int, origin_us: float, spans: list[tuple[str, float, float]]) -> None:
    tl = Timeline(str(path), rank=rank)
    for name, start, end in spans:
        tl.event(name, "allreduce", start, end)
    tl.close()
    doc = json.loads(path.read_text())
    for e in doc["traceEvents"]:  # pin the clock origin to a known value
        if e["name"] == "process_name":
            e["args"]["origin_epoch_us"] = origin_us
    path.write_text(json.dumps(doc))


def test_merge_shifts_each_rank_onto_the_earliest_origin(tmp_path: Path) -> None:
    main = tmp_path / "tl.json"
    _fake(main, 0, origin_us=1_000_500.0, spans=[("grad", 10.0, 20.0)])
    _fake(Path(rank_path(str(main), 1)), 1, origin_us=1_000_000.0, spans=[("grad", 30.0, 35.0)])
    out = merge_timelines(str(main), 3, out=str(tmp_path / "all.json"))  # rank 2's file is missing
    events = json.loads(Path(out).read_text())["traceEvents"]
    xs = sorted((e["pid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X")
    assert xs == [(0, 510.0, 10.0), (1, 30.0, 5.0)]  # rank 0 started 500 us after rank 1
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"grad"}


def test_merge_reads_a_file_cut_mid_write(tmp_path: Path) -> None:
    main = tmp_path / "tl.json"
    tl = Timeline(str(main))
    tl.event("a", "allreduce", 1.0, 2.0)
    tl.event("b", "allreduce", 3.0, 4.0)
    tl.close()
    text = main.read_text()
    main.write_text(text[: text.rindex("}") - 3])  # the last event and the closing ]} are cut
    events = json.loads(Path(merge_timelines(str(main), 1, out=str(tmp_path / "m.json"))).read_text())
    assert [e["args"]["tensor"] for e in events["traceEvents"] if e["ph"] == "X"] == ["a"]


def test_merge_needs_rank_0(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        merge_timelines(str(tmp_path / "none.json"), 2)
