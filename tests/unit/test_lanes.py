"""``make test``'s lanes (tests/lanes.py) run every test folder, each exactly once."""

from __future__ import annotations

from pathlib import Path

from tests import lanes


def test_every_folder_with_tests_is_in_exactly_one_lane() -> None:
    tests_dir = Path(lanes.__file__).parent
    with_tests = {p.parent.relative_to(tests_dir).parts[0] for p in tests_dir.rglob("test_*.py")
                  if p.parent != tests_dir}
    in_lanes = [folder for lane in lanes.LANES for folder in lane.folders]
    assert sorted(in_lanes) == sorted(with_tests)


def test_reverse_gives_each_lanes_files_in_reverse_order() -> None:
    e2e = next(lane for lane in lanes.LANES if len(lane.folders) > 1)
    files = lanes._targets(e2e, reverse=True)
    assert files == sorted(files, reverse=True)
    assert {Path(f).parts[1] for f in files} == set(e2e.folders)
    assert all(Path(f).name.startswith("test_") for f in files)


def test_slowest_reads_cases_from_every_junit_file(tmp_path: Path) -> None:
    for name, cases in (("a", [("tests.unit.test_x", "t1", "0.5"), ("tests.unit.test_x", "t2", "3.0")]),
                        ("b", [("tests.multihost.test_y", "t3", "2.0")])):
        body = "".join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
        (tmp_path / f"{name}.xml").write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    got = lanes.slowest([tmp_path / "a.xml", tmp_path / "b.xml", tmp_path / "missing.xml"], count=2)
    assert got == [(3.0, "tests/unit/test_x.py::t2"), (2.0, "tests/multihost/test_y.py::t3")]
