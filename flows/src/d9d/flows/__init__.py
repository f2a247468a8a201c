"""d9d-flows: Prefect flows per stage, the pipeline flow, and the `d9d` command line."""
