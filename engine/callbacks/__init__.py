"""Logging sinks and alarms: callbacks of the training loop (their protocol: engine.train.callback)."""
