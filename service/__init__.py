"""posttrain's Tinker-compatible training service (`posttrain serve`): write your own loop
against the official `tinker` SDK and run it here. See `app.py` for the routes and
docs/service.md for a tour."""
