"""The `d9d-states` command line."""
