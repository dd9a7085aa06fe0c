"""Integrations with Hugging Face libraries: `integrations.accelerate` (launcher, ZeroPlugin)."""
