"""Rank programs, job configuration and wiring. Runs under torchrun or in one process; never imports Prefect."""
