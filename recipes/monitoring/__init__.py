"""Where a run's numbers go and what is said about them: the metrics log, the
dashboard, health advisories and advice."""
