"""The engine process: a backend that runs in a process of its own, driven over one pipe (engine.process.client)."""
