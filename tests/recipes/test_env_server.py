"""`rollout.environment.serve`: the run starts its environment server (the example
OpenEnv game) on a free port, waits for its health, and stops it (its whole process
group) on every exit; a server that never becomes healthy, or exits, fails the start
before any rollout worker or learner starts; bad keys are refused at validate. No Ray:
the roles after the server are stand-ins."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from posttrain.config import RecipeError
from posttrain.recipes import roles
from posttrain.recipes.algo import algorithm_for
from posttrain.recipes.episodes.step import environment_factory
from posttrain.recipes.loading import load_recipe
from posttrain.recipes.placement import Placement
from posttrain.recipes.roles import env_server
from posttrain.recipes.roles import start as role_start

ROOT = Path(__file__).resolve().parents[2]
GAME = ["python", str(ROOT / "examples" / "openenv_game.py"), "--port", "{port}"]
URL = "http://127.0.0.1:{port}"


def _recipe(tmp_path: Path, serve: dict, url: str = URL) -> Path:
    tree = yaml.safe_load((ROOT / "examples" / "openenv_game.yaml").read_text())
    tree["rollout"]["environment"].update(url=url, serve=serve)
    f = tmp_path / "recipe.yaml"
    f.write_text(yaml.safe_dump(tree))
    return f


@pytest.fixture
def launched(monkeypatch):
    """Every server `launch` started in the test (to check each is gone)."""
    servers = []
    launch = env_server.launch

    def launch_and_note(*args, **kwargs):
        servers.append(launch(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(env_server, "launch", launch_and_note)
    return servers


def _gone(server: env_server.EnvironmentServer) -> bool:
    deadline = time.time() + 15
    while server.proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    return server.proc.poll() is not None and not env_server._listening(server.url)


def test_the_server_is_started_used_and_stopped(tmp_path, launched):
    recipe = load_recipe(_recipe(tmp_path, {"command": GAME, "ready_timeout_s": 60}))
    held = roles.Roles(learners=[], placement=Placement())
    roles.start_environment_server(held, recipe, tmp_path)
    try:
        server = held.env_server
        assert server is launched[0] and server.url.startswith("http://127.0.0.1:")
        assert "{port}" not in server.url and server.proc.poll() is None
        env = environment_factory(recipe, None, 0, server.url)("s0-p1-0")
        try:  # an episode against it, over OpenEnv's WebSocket
            assert env.reset(_request())[-1]["role"] == "user"
            assert env.step("50").messages[0]["content"].endswith("wrong: go lower.")
        finally:
            env.close()
    finally:
        roles.stop_roles(held)
    assert _gone(server), "the environment server is still running"
    assert (tmp_path / "environment_server.log").is_file()
    roles.stop_roles(held)  # twice is fine


def test_an_http_environment_server_is_started_too(tmp_path, launched):
    """`serve` is a key of every environment reached over the network: our own HTTP
    protocol's example game, started by the run and played."""
    tree = yaml.safe_load((ROOT / "examples" / "openenv_game.yaml").read_text())
    guess = ["python", str(ROOT / "examples" / "guess_env.py"), "--port", "{port}"]
    tree["rollout"]["environment"] = {"type": "http", "url": URL, "serve": {"command": guess}}
    f = tmp_path / "http.yaml"
    f.write_text(yaml.safe_dump(tree))
    recipe = load_recipe(f)
    held = roles.Roles(learners=[], placement=Placement())
    try:
        roles.start_environment_server(held, recipe, tmp_path)
        env = environment_factory(recipe, None, 0, held.env_server.url)("s0-p1-0")
        try:
            assert env.reset(_request()) == [{"role": "user", "content": "?"}]
            assert env.step("no number").messages[0]["role"] == "user"
        finally:
            env.close()
    finally:
        roles.stop_roles(held)
    assert _gone(launched[0])


def _request():
    from posttrain.actors.rollout import PromptRequest

    return PromptRequest("s0-p1-0", [{"role": "user", "content": "?"}])


def _start_roles_failing_after_the_server(monkeypatch, tmp_path, recipe_file):
    """`start_roles` with every role after the environment server a test failure."""
    recipe = load_recipe(recipe_file)

    def never(*args, **kwargs):
        pytest.fail("a role started after a failed environment server")

    monkeypatch.setattr(role_start, "place", lambda res, rollout: Placement([{}], [{}]))
    monkeypatch.setattr(role_start, "start_rewards", never)
    monkeypatch.setattr(role_start, "start_rollout", never)
    monkeypatch.setattr(role_start, "_launch_learners", never)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    roles.start_roles(recipe, algorithm_for(recipe), "unused-model", run_dir)


def test_a_server_that_never_becomes_healthy_fails_the_start_first(tmp_path, monkeypatch, launched):
    silent = ["python", "-c", "import sys, time; print('up on', sys.argv[1]); time.sleep(60)"]
    f = _recipe(tmp_path, {"command": [*silent, "{port}"], "ready_timeout_s": 1.5})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as got:
        _start_roles_failing_after_the_server(monkeypatch, tmp_path, f)
    assert time.monotonic() - t0 < 30  # the deadline, not the program's 60 s
    message = str(got.value)
    assert "did not answer GET http://127.0.0.1:" in message and "/health" in message
    assert "rollout.environment.serve.ready_timeout_s" in message
    assert "environment_server.log" in message and "up on" in message  # its log's tail
    assert _gone(launched[0])


def test_a_server_that_exits_fails_the_start_naming_its_code_and_log(
    tmp_path, monkeypatch, launched
):
    dies = ["python", "-c", "import sys; print('no such game', sys.argv[1]); sys.exit(3)"]
    f = _recipe(tmp_path, {"command": [*dies, "{port}"]})
    with pytest.raises(RuntimeError, match=r"exited with code 3[\s\S]*no such game"):
        _start_roles_failing_after_the_server(monkeypatch, tmp_path, f)
    assert _gone(launched[0])


def test_ctrl_c_while_waiting_stops_the_server(tmp_path, monkeypatch, launched):
    silent = ["python", "-c", "import time; time.sleep(60)", "{port}"]
    f = _recipe(tmp_path, {"command": silent, "ready_timeout_s": 60})

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(env_server.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _start_roles_failing_after_the_server(monkeypatch, tmp_path, f)
    monkeypatch.undo()  # _gone sleeps
    assert _gone(launched[0])


def test_a_fixed_port_already_in_use_fails_the_start(tmp_path, monkeypatch, launched):
    import openenv_game  # examples/ is on the path (the autouse fixture below)

    from tests.hostile_servers import serve_app

    with serve_app(openenv_game.create_app()) as url:  # a server left running
        f = _recipe(tmp_path, {"command": [*GAME[:3], url.rsplit(":", 1)[1]]}, url=url)
        with pytest.raises(RuntimeError, match="another process already listens there"):
            _start_roles_failing_after_the_server(monkeypatch, tmp_path, f)
    assert launched == []


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


@pytest.mark.parametrize(
    ("url", "serve", "says"),
    [
        (URL, None, "rollout.environment.url 'http://127.0.0.1:{port}' has {port}, which only"),
        (URL, {"command": ["python", "game.py"]}, "url has {port} but rollout.environment.serve"),
        ("http://127.0.0.1:9200", {"command": GAME}, "serve.command has {port} but"),
        ("http://10.1.2.3:{port}", {"command": GAME}, "starts the server on this machine"),
        (URL, {"command": ["pyhton", "{port}"]}, "serve.command[0] 'pyhton' is not a program"),
        (URL, {"command": GAME, "ready_timeout_s": 0}, "ready_timeout_s"),
        (URL, {"command": GAME, "health_path": "health"}, "health_path 'health' must start"),
    ],
)
def test_validate_refuses_a_bad_serve_naming_the_key(tmp_path, url, serve, says):
    tree = yaml.safe_load((ROOT / "examples" / "openenv_game.yaml").read_text())
    tree["rollout"]["environment"]["url"] = url
    if serve is None:
        tree["rollout"]["environment"].pop("serve")
    else:
        tree["rollout"]["environment"]["serve"] = serve
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError) as got:
        load_recipe(f)
    assert says in str(got.value) and "rollout.environment" in str(got.value)


@pytest.mark.parametrize("fails", [False, True])
def test_posttrain_eval_starts_and_stops_the_server_too(tmp_path, monkeypatch, launched, fails):
    """`posttrain eval` samples on roles of its own (recipes/assess/scoring.py): the
    server is up while it samples, at the url the episodes get, and stopped after, also
    when sampling fails. Stand-ins for Ray and the rollout workers."""
    import ray

    from posttrain.recipes import evaluation
    from posttrain.recipes.assess import scoring

    recipe = load_recipe(_recipe(tmp_path, {"command": GAME}))
    seen = []

    def sample(held, *args):
        seen.append(held.env_server.proc.poll())
        if fails:
            raise RuntimeError("sampling failed")
        return {}, [], []

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", lambda refs: [])
    monkeypatch.setattr("posttrain.recipes.placement.place", lambda res, rollout: Placement())
    monkeypatch.setattr(roles, "start_rewards", lambda recipe, out: (None, None))
    monkeypatch.setattr(roles, "rollout_spec", lambda *a: None)
    monkeypatch.setattr(roles, "transport_settings", lambda *a: None)
    monkeypatch.setattr(roles, "start_rollout", lambda spec, placement: [])
    monkeypatch.setattr(evaluation, "sample_and_score", sample)
    if fails:
        with pytest.raises(RuntimeError, match="sampling failed"):
            scoring._sample_on_roles(recipe, "model", [], tmp_path / "eval")
    else:
        scoring._sample_on_roles(recipe, "model", [], tmp_path / "eval")
    assert seen == [None]  # running while it sampled
    assert _gone(launched[0]) and (tmp_path / "eval" / "environment_server.log").is_file()
