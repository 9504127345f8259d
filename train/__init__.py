"""mtpkit.train."""
