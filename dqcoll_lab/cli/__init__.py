"""The lab's command line: ``python -m dqcoll_lab <command>`` (console script ``dqcoll-lab``)."""
