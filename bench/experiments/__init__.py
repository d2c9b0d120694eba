"""Kernel experiments kept for their measurements (bench/NOTES.md); not part of msda."""
