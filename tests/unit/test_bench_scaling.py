"""bench/scaling.py's report files from given measurements (the runs themselves are a benchmark)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
_spec = importlib.util.spec_from_file_location(
    "bench_scaling", Path(__file__).resolve().parents[2] / "bench" / "scaling.py"
)
scaling = importlib.util.module_from_spec(_spec)
sys.modules["bench_scaling"] = scaling  # dataclasses look their module up there
_spec.loader.exec_module(scaling)


def test_csv_and_png(tmp_path: Path) -> None:
    points = [scaling.Point(1, 1000.0, 1.0, (1000.0,)), scaling.Point(2, 1800.0, 0.9, (1750.0, 1800.0))]
    scaling.write_csv(points, tmp_path / "scaling.csv")
    rows = list(csv.DictReader((tmp_path / "scaling.csv").open()))
    assert [(r["processes"], r["tokens_per_s"], r["ideal_tokens_per_s"], r["efficiency"]) for r in rows] == [
        ("1", "1000.0", "1000.0", "1.0000"), ("2", "1800.0", "2000.0", "0.9000")]
    scaling.write_png(points, tmp_path / "scaling.png", "test")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        scaling._args(["--max-np", "1"])
    ns = scaling._args(["--steps", "10", "--", "model.n_layer=2"])
    assert ns.steps == 10 and ns.overrides == ["model.n_layer=2"] and ns.threads == 1
