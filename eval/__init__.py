"""mtpkit.eval."""
