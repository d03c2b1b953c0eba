"""Command line: ``dqcoll demo | bench | eval | tune | simulate``."""
