"""Capacity planning (`posttrain plan`): the formulas, the GPU planner, the CPU
calibration and their console views. No torch at module level but in calibrate.py and
calibration_cache.py."""
