"""Procedural tasks the data blocks generate (beside reasoning-gym\x27s)."""
