"""mtpkit.data."""
