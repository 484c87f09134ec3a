"""The wire format: the protocol's message schemas and the group sends that reach a worker's
session. A leaf: it imports none of the project's apps, so every layer (and a worker) can use it."""
