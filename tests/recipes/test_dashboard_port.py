"""`posttrain run`'s dashboard port: the default (8765) taken by another run gives way to a
free port; a port the user names must be free (exit 2, naming the key)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import typer

from posttrain.recipes.cli import checks as cli_checks
from posttrain.recipes.loading import load_recipe

QUICK = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_grpo.yaml"


@pytest.fixture
def port_8765_taken():
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        held.bind(("127.0.0.1", 8765))
        held.listen()
    except OSError:
        pass  # another process holds it: the same case
    yield
    held.close()


def test_the_default_port_in_use_gives_way_to_a_free_one(port_8765_taken, capsys):
    r = load_recipe(QUICK)
    assert r.monitor.dashboard_port == 8765 and "dashboard_port" not in r.monitor.model_fields_set
    got = cli_checks.port_or_exit(r)
    assert got.monitor.dashboard_port == 0 and got.train == r.train
    assert "8765 is in use" in capsys.readouterr().out


def test_a_named_port_in_use_exits_2(port_8765_taken, capsys):
    r = load_recipe(QUICK, ["monitor.dashboard_port=8765"])
    with pytest.raises(typer.Exit) as e:
        cli_checks.port_or_exit(r)
    assert e.value.exit_code == 2
    assert "monitor.dashboard_port: 127.0.0.1:8765 is in use" in capsys.readouterr().err


def test_off_and_any_port_pass_through():
    for value in ("null", "0"):
        r = load_recipe(QUICK, [f"monitor.dashboard_port={value}"])
        assert cli_checks.port_or_exit(r) is r


def test_true_is_not_a_port():
    from posttrain.config import RecipeError

    with pytest.raises(RecipeError, match="monitor.dashboard_port"):
        load_recipe(QUICK, ["monitor.dashboard_port=true"])
