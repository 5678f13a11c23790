"""Shared fixtures: a tiny random model folder, the repo root, the shared data folder, a
local Ray instance per test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Keep every test process to the cores it may use; never download anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of one CPU for the test module (modules that need other
    resources define their own)."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide random Llama with tied embeddings and a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_model_pad_eos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama whose pad token is its EOS `<|im_end|>` (id 3), as SmolLM2 ships
    (pad = eos = 2)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_pad_eos") / "model", pad_token="<|im_end|>"
    )


@pytest.fixture(scope="module")
def hf_worker(tmp_path_factory: pytest.TempPathFactory):
    """(a rollout worker on the `hf` engine over a tiny Llama with room for 1024
    positions, that model's folder), in this process (no Ray); closed after the module."""
    from posttrain.actors.engine import EngineSettings
    from posttrain.actors.worker import RolloutWorker

    folder = build_tiny_model(tmp_path_factory.mktemp("hf_worker") / "m", max_positions=1024)
    settings = EngineSettings(kind="hf", model_path=str(folder), dtype="float32")
    w = RolloutWorker(0, settings, "object_store", threads=1)
    yield w, folder
    w.close()


@pytest.fixture(scope="session")
def tiny_model_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama widened to head_dim 32 (vLLM's CPU attention needs it), with room
    for 1024 positions."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_vllm") / "model", hidden=128, max_positions=1024
    )


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present (tests and benchmarks only)")
    return SHARED_DATA


#: The quick tier (`pytest -m quick`, docs/contributing.md): the default run's tests
#: except those using a `NOT_QUICK_FIXTURES` fixture (Ray, vLLM, a module's training
#: runs) and these, by node id prefix: training runs, CLI and service processes started
#: per test, spawned learner ranks, compiles. Chosen from per-test times of the default
#: run on 2 cores; a test that grows past a few seconds joins the list.
NOT_QUICK: tuple[str, ...] = (
    "tests/test_",  # end-to-end runs (top-level modules)
    "tests/bench/",  # each bench's smoke mode, a process per bench
    "tests/packaging/test_wheel.py",
    "tests/packaging/test_fresh_clone.py",
    "tests/rewards/test_reward_model_folder.py",
    "tests/rewards/test_hostile_rewards.py",
    "tests/rewards/test_sandbox.py",
    "tests/rewards/test_service_restart.py",
    "tests/rewards/test_user_rewards.py::test_serve_rewards_cli",
    "tests/recipes/test_evaluation.py",
    "tests/recipes/test_hacking_dashboard.py",  # headless Chromium, ~20 s
    "tests/recipes/test_dynamic.py",
    "tests/recipes/test_episode_parity.py",
    "tests/recipes/test_placement.py",
    "tests/recipes/test_start_fail_fast.py",
    "tests/recipes/test_planner.py::test_plan_cli",
    "tests/recipes/test_plan_cpu.py::test_plan_cpu_cli_on_a_tiny_model",
    "tests/recipes/test_plan_cpu.py::test_calibration_is_cached_per_machine_and_shape",
    "tests/recipes/test_schema.py::test_cli_exit_codes",
    "tests/recipes/test_schema.py::test_response_longer_than_",
    "tests/recipes/test_schema.py::test_empty_stop_string_exits_2",
    "tests/recipes/test_schema.py::test_overlong_buffer_not_below_max_new_tokens_exits_2",
    "tests/recipes/test_schema.py::test_run_converts_the_alias",
    "tests/recipes/test_data.py::test_reward_runtime_checks_find_modules_without_importing",
    "tests/recipes/test_data.py::test_dpo_data_errors_name_real_key_paths",
    "tests/recipes/test_data.py::test_validate_reads_rows_and_run_refuses_used_folder",
    "tests/recipes/test_environments.py::test_a_one_million_token_reset_fails_its_episode",
    "tests/recipes/test_openenv.py::test_a_faulty_openenv_server_fails_only_its_episodes",
    "tests/learner/test_logprobs.py::test_compiled_layers_match_eager",
    "tests/learner/test_logprobs.py::test_packed_prompts_under_fsdp2_match_full_logits",
    "tests/learner/test_logprobs.py::test_chunked_head_under_fsdp2_matches_full_logits",
    "tests/learner/test_micro_batches.py::test_token_budget_does_not_change_the_step",
    "tests/learner/test_micro_batches.py::test_entropy_under_the_sampling_temperature",
    "tests/learner/test_checkpoint_state.py",
    "tests/learner/test_devices_learner.py",
    "tests/learner/test_fsdp.py",
    "tests/learner/test_nonfinite_step.py",
    "tests/learner/test_reward_model_learner.py",
    "tests/learner/test_reward_model_pad_eos.py",
    "tests/learner/test_shm_gather.py",
    "tests/learner/test_teacher_reference.py",
    "tests/weightsync/test_object_store.py",
    "tests/weightsync/test_transports.py::test_a_broadcast_still_running_after_finish_blocks",
    "tests/service/test_cli_serve.py",
    "tests/service_roles/",  # services on real roles, started per test
    "tests/learner/test_sessions.py",  # spawned ranks and Ray learners
    "tests/learner/test_sessions_batched.py",  # spawned ranks and Ray learners
    "tests/learner/test_sessions_ray.py",  # spawned ranks and Ray learners
    "tests/learner/test_tied_head_lora.py",
    "tests/weightsync/test_base_push.py",
    "tests/actors/test_named_adapters.py",
    "tests/actors/test_request_seeds.py",
    "tests/rewards/test_sandbox_memory.py",
)

#: One end-to-end smoke per role, quick although NOT_QUICK or its fixtures would leave
#: it out: each starts its role for real (a Ray actor, spawned ranks, a service process)
#: and drives it through its verbs; the run starts them all and takes two GRPO steps.
QUICK_SMOKES: dict[str, str] = {
    "actors": "tests/actors/test_engines.py::test_groups_and_lengths[hf]",
    "learner": "tests/learner/test_fsdp.py::test_small_update_reaches_fp32_master_weights",
    "rewards": "tests/rewards/test_service.py::test_five_items_in_order_with_details",
    "weightsync": (
        "tests/weightsync/test_push.py::test_push_reaches_every_engine_and_waits_for_the_learners"
    ),
    "run": "tests/test_grpo_e2e.py::test_two_grpo_steps[split]",
}
#: Fixtures that start Ray, vLLM or a training run: a test using one is not quick.
NOT_QUICK_FIXTURES = ("ray_local", "tiny_model_vllm", "slowed_runs", "served")


def is_quick(item: pytest.Item) -> bool:
    """In the quick tier: not slow, vLLM or GPU, and either a `QUICK_SMOKES` entry or
    neither using a `NOT_QUICK_FIXTURES` fixture nor listed in `NOT_QUICK`."""
    if any(m in item.keywords for m in ("slow", "vllm", "gpu")):
        return False
    if item.nodeid in QUICK_SMOKES.values():
        return True
    if any(f in NOT_QUICK_FIXTURES for f in getattr(item, "fixturenames", ())):
        return False
    return not any(item.nodeid.startswith(p) for p in NOT_QUICK)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the quick tier (`quick`); `@pytest.mark.gpu` tests need a CUDA device:
    skipped where torch sees none."""
    import torch

    for item in items:
        if is_quick(item):
            item.add_marker(pytest.mark.quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
