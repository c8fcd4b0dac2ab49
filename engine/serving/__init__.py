"""What the managed HTTP servers share: the guarded process, its environment, and caps on what a server sends."""
