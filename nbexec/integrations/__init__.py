"""Integrations with agent frameworks; each needs its optional extra."""
