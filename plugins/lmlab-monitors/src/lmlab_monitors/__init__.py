"""Training-health monitors for lmlab (the ``monitor`` slot): each acts through the lifecycle hooks."""
