"""The roles of one run, from the control plane's side.

- `settings`: what each role is started with, built from the recipe as plain values (the
  engine, a rollout worker's spec, the weight transport, the learner ranks' settings).
- `start`: starting and stopping the learner group, the rollout workers and their push
  group, the reward service; the embedded Ray cluster and the run folder's manifest.
- `env_server`: the environment server a run starts itself (`rollout.environment.serve`).
- a verifiers v1 environment's drivers (`Roles.vf1_drivers`, recipes/episodes/vf1.py):
  started at the run's first step of its episodes, stopped by `stop_roles`.
- `handles`: what a run holds of them (`Roles`), how to start each again
  (`RelaunchSpecs`) and what it counts of them (`RunCounters`: who may mutate, said
  there).

The named calls a step is made of are in recipes/controller.py.
"""

from .env_server import EnvironmentServer, start_environment_server
from .handles import LocalServiceLaunch, RelaunchSpecs, Roles, RunCounters
from .settings import (
    RolloutSpec,
    adapter_sync,
    engine_settings,
    learner_settings,
    rollout_concurrency,
    rollout_spec,
    transport_settings,
)
from .start import (
    get_watching,
    init_ray,
    reform_push_group,
    start_learners,
    start_rewards,
    start_roles,
    start_rollout,
    start_rollout_worker,
    stop_roles,
    write_manifest,
)

__all__ = [
    "EnvironmentServer",
    "LocalServiceLaunch",
    "RelaunchSpecs",
    "Roles",
    "RolloutSpec",
    "RunCounters",
    "adapter_sync",
    "engine_settings",
    "get_watching",
    "init_ray",
    "learner_settings",
    "reform_push_group",
    "rollout_concurrency",
    "rollout_spec",
    "start_environment_server",
    "start_learners",
    "start_rewards",
    "start_roles",
    "start_rollout",
    "start_rollout_worker",
    "stop_roles",
    "transport_settings",
    "write_manifest",
]
