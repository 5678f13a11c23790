"""Overrides shared by the benches that run a recipe in process: no progress bar, no
dashboard, no TensorBoard or rollout files, no final save (I/O the timings should not hold)."""

QUIET = [
    "monitor.progress=false",
    "monitor.dashboard_port=null",
    "monitor.tensorboard=false",
    "monitor.save_rollouts=false",
    "train.save_final=false",
]
