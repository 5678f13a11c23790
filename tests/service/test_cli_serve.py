"""`posttrain serve` refuses, before it listens, a key the SDK would refuse and a model
folder that is not one (exit 2, naming the setting)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from posttrain.recipes.cli import app


def test_serve_refuses_a_key_without_the_sdk_prefix() -> None:
    out = CliRunner().invoke(app, ["serve"], env={"POSTTRAIN_SERVE_TOKEN": "secret"})
    assert out.exit_code == 2 and "POSTTRAIN_SERVE_TOKEN" in out.output


def test_serve_refuses_a_model_that_is_not_a_folder(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        app, ["serve", "--model", str(tmp_path / "nope")], env={"POSTTRAIN_SERVE_TOKEN": "tml-x"}
    )
    assert out.exit_code == 2 and "--model" in out.output


def test_serve_refuses_a_bad_config_key_naming_it_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "serve.yaml"
    bad.write_text("sessions: {nope: 1}\n")
    out = CliRunner().invoke(
        app, ["serve", "--config", str(bad)], env={"POSTTRAIN_SERVE_TOKEN": "tml-x"}
    )
    assert out.exit_code == 2 and "sessions.nope: unknown key" in out.output
    bad.write_text("sessions: {max_rank: true}\n")
    out = CliRunner().invoke(
        app, ["serve", "--config", str(bad)], env={"POSTTRAIN_SERVE_TOKEN": "tml-x"}
    )
    assert out.exit_code == 2 and "max_rank" in out.output and "boolean" in out.output


def test_serve_names_a_model_path_that_does_not_exist(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        app, ["serve", "--model", str(tmp_path / "nope")], env={"POSTTRAIN_SERVE_TOKEN": "tml-x"}
    )
    assert out.exit_code == 2 and "does not exist" in out.output
