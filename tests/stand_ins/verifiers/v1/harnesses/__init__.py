"""Stand-in of `verifiers.v1.harnesses`: the built-in harness plugins (`null`, `bash`)."""
