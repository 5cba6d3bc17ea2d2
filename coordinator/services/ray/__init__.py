"""Ray: each environment a detached actor of an existing Ray cluster."""
