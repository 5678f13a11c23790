"""`posttrain eval`: a saved model on a recipe's held-out set (targets.py: what TARGET
is; scoring.py: the evaluations; command.py: options, dispatch and the report)."""
