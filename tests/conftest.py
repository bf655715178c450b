"""Shared pytest setup. Fixtures for real components live in tests/fixtures/."""
