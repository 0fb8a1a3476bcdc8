"""Trainers: the RL driver, SFT, RM and preference jobs (checkpoint I/O: `tiller.models.checkpoint`)."""
