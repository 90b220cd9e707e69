"""The engine process: one process owns the device and runs the batches of every HTTP worker."""
