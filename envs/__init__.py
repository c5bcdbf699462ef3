"""Environments shipped with quaero (OpenEnv Environment / MCPEnvironment subclasses)."""
