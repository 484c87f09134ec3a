"""gradient-worker: the agent that connects one machine to the server and runs what it is
assigned as real processes (protocol.md, "Running real work"). Imports nothing of Django."""
