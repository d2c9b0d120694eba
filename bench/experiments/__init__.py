"""Timings of kernel options msda has but does not take by default (bench/NOTES.md)."""
