"""Replaying a search in virtual time against the learning curves an experiment recorded."""
