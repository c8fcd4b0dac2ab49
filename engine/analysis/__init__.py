"""Finished runs analysed: bootstrap intervals and the sampling check."""
