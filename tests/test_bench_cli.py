"""Every benchmark `spanserve bench NAME` lists can be run from the CLI."""

import importlib

import pytest

from spanserve.cli import BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_every_listed_bench_has_the_cli_entry_points(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and callable(module.run) and callable(module.add_arguments)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
