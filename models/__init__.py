"""mtpkit.models."""
