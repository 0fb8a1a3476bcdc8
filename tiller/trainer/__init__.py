"""Trainers (RL driver, SFT, RM, preference) and their shared checkpointing (`tiller.trainer.checkpoint`)."""
