"""Small pieces every role uses: telemetry spans, model aliases, process set-up."""
