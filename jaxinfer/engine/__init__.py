"""Scheduler, runner, sampling and ahead-of-time compilation."""
