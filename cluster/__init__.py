"""pdserve cluster package."""
