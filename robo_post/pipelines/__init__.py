"""End-to-end recipes built from the store, the fleet, the method registry and the learner (the LWD loop)."""
