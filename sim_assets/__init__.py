"""MJCF scenes for the simulated robots (data package)."""
