"""`python -m posttrain.recipes.cli`: the `posttrain` command."""

from . import main

main()
