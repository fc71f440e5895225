"""The planner (``offload plan``): ``planner`` (the arithmetic), ``activations``, ``choice`` (the ways
to a batch), ``cli`` (the command)."""
