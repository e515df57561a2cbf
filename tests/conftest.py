"""Shared pytest fixtures for meshd."""
