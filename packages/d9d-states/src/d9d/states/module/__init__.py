"""Loading into and saving from modules (DTensor-aware)."""
