"""Helpers every layer may use (files written atomically, file locks, log reading, torch
devices); they import nothing else of robo_post, so any package can depend on them."""
